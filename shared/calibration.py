"""A drafter's confidence in a draft token -> the probability that the verifier accepts it.

AdaSpec (adaspec.txt §5.1) estimates acceptance from draft confidence and "calibrates" it with the
outcomes of past rounds. Calibration matters: a draft model's probability for its own token is not
the probability that the target accepts it. On the demo pair, greedy, the draft's top-1
probability is far below the measured acceptance (about 0.84 per token), so uncalibrated
confidences made AdaSpec's trim drop most drafts that would have been accepted.

The estimate is per confidence bin: the mean of the bin's outcomes and its prior (the bin's
midpoint, weighted as ``PRIOR_WEIGHT`` outcomes) while it has fewer than about 1/``ALPHA`` of
them, then a moving average. A plain moving average from the prior learned too slowly: with the
demo pair's top-1 probabilities around 0.25 and acceptance around 0.8, AdaSpec's drafter
believed its second draft would fail, drafted one token a round, and so taught the bins of
longer drafts next to nothing, and ran slower than fixed k. Only judged drafts teach it:
in a round whose first ``accepted`` drafts were accepted, drafts ``0..accepted-1`` count as
accepted and draft ``accepted`` (if it was sent) as rejected; later drafts were never judged. So
the estimate is the conditional acceptance given the drafts before were accepted, which is what
AdaSpec's chain of products (eq. 6-7) needs. Each bin starts at its own midpoint, that is at
the raw confidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

BINS = 10  # confidence bins
ALPHA = 0.05  # weight of a new outcome in a bin's moving average
PRIOR_WEIGHT = 1.0  # the bin's midpoint counts as this many outcomes of its bin


def ewma(old: float, new: float, alpha: float = ALPHA) -> float:
    return (1 - alpha) * old + alpha * new


def judged(drafted: int, accepted: int) -> int:
    """Drafts a round's verdict judged: the ``accepted`` ones, and the first rejected one if the
    round stopped short of its ``drafted`` drafts (the later ones were never compared)."""
    return min(drafted, accepted + 1)


def _bin(confidence: float) -> int:
    return min(BINS - 1, max(0, int(confidence * BINS)))


@dataclass
class AcceptanceCalibration:
    """Confidence -> probability of acceptance (given the drafts before it were accepted)."""

    rate: list[float] = field(default_factory=lambda: [(b + 0.5) / BINS for b in range(BINS)])
    seen: list[int] = field(default_factory=lambda: [0] * BINS)  # judged drafts per bin

    def accept(self, confidence: float) -> float:
        return self.rate[_bin(confidence)]

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """Drafts 0..accepted-1 were accepted, draft ``accepted`` (if sent) rejected."""
        for i, c in enumerate(confidences[: judged(len(confidences), accepted)]):
            b = _bin(c)
            self.seen[b] += 1
            weight = max(ALPHA, 1.0 / (PRIOR_WEIGHT + self.seen[b]))  # the running mean, then the EWMA
            self.rate[b] = ewma(self.rate[b], 1.0 if i < accepted else 0.0, weight)
