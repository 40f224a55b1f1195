"""Trim by calibrated confidence (``--trim adaspec``): AdaSpec's confidence prior verifier, draft
token elimination (adaspec.txt §5.2, Alg. 2), scored by the SLO-aware efficiency estimator (§5.3,
Alg. 3).

Efficiency of a batch (§4, §5.3): expected committed tokens over the predicted step time,

    eff = (sum_sessions (E_s + 1) + |fixed|) / (T(shapes) + gap),

where E_s = sum_{j<=k_s} prod_{i<=j} c_{s,i} is the expected number of the k_s kept drafts that
are accepted (§4.2 eq. 6-7; ``base.expected_accepted``). c_{s,i} is the probability that draft
i is accepted given drafts 1..i-1 were: the drafter's confidence, calibrated against that
drafter's past verdicts (``shared.calibration``, fed by ``observe_round``) before the trim reads it. T is the
verifier's step-time model over the segment shapes of the whole batch (each trimmable session
feeds ``fed + k_s`` rows on ``cached`` rows, plus the untrimmable ``fixed`` segments).

The efficiency's time is the step's period: the predicted forward plus ``gap_s``, the measured
time between forwards that no trim shortens (``base.rate``).

Elimination (§5.2): the draft token with the lowest estimated acceptance prod_{i<=j} c_{s,i} is
considered first. The running product never rises along a draft, so that token is always some
session's last kept draft: a min-heap over the sessions' tails yields the candidates in order in
O(n log n) for n drafts. A candidate is dropped if that raises the efficiency; elimination stops
at the first candidate whose drop does not (the paper's stopping rule, justified by the
quasi-concavity of §4.3). Each candidate costs one ``model.predict``.

TPOT guard (§5.3): with ``tpot_slo_s`` set, a batch whose predicted step time exceeds the SLO is
refused (Alg. 3 scores it -1), so candidates are dropped regardless of efficiency while the
prediction is over the SLO, until it fits or no drafts remain; ``last.fits_slo`` says which.

In the engine (``decide``), every ``PROBE_EVERY``-th step that has drafts to trim is verified
untrimmed instead: a draft the trim drops is never judged, so without these probes a calibration
bin whose estimate fell too low could never recover. ``gap_s`` is a moving average of the
measured gaps (``observe_gap``).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.verifier.trim.base import (
    SegmentShape,
    StepTimeModel,
    TrimItem,
    TrimReport,
    acceptance_chain,
    check_items,
    check_slo,
    fits,
    rate,
)
from shared.calibration import AcceptanceCalibration, ewma

#: every this many trimmable steps, one is verified untrimmed (module docstring)
PROBE_EVERY = 8
#: calibrations kept, the drafters heard from least recently dropped first
MAX_CALIBRATIONS = 256
#: weight of a new gap between steps in the moving average of it
GAP_ALPHA = 0.1
#: a longer gap between steps is idleness between requests, not part of a step's period
MAX_GAP_S = 0.5


@dataclass
class _Batch:
    """The batch as currently kept, during elimination."""

    items: Sequence[TrimItem]
    chains: list[list[float]]
    kept: list[int]
    shapes: list[SegmentShape]  # items' segments first, then the fixed ones
    tokens: float
    seconds: float
    gap_s: float = 0.0
    predictions: int = 1

    @classmethod
    def full(cls, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape],
             gap_s: float) -> _Batch:
        chains = [acceptance_chain(item.confidence) for item in items]
        shapes = [item.shape(item.drafts) for item in items] + list(fixed)
        tokens = len(shapes) + sum(sum(chain) for chain in chains)
        return cls(items, chains, [len(c) for c in chains], shapes, tokens, model.predict(shapes), gap_s)

    def tails(self) -> list[tuple[float, int, int]]:
        """Heap entries (acceptance of the last kept draft, -its position, item index)."""
        return [self.tail(i) for i, k in enumerate(self.kept) if k > 0]

    def tail(self, i: int) -> tuple[float, int, int]:
        k = self.kept[i]
        return self.chains[i][k - 1], -k, i

    def try_drop(self, i: int, model: StepTimeModel, tpot_slo_s: float | None) -> bool:
        """Drop session i's last kept draft if that raises the efficiency or the batch is over the
        SLO; otherwise leave the batch as it was. Returns whether it dropped."""
        k = self.kept[i] - 1
        self.shapes[i] = self.items[i].shape(k)
        seconds = model.predict(self.shapes)
        self.predictions += 1
        tokens = self.tokens - self.chains[i][k]
        over_slo = tpot_slo_s is not None and self.seconds > tpot_slo_s
        if over_slo or rate(tokens, seconds, self.gap_s) > rate(self.tokens, self.seconds, self.gap_s):
            self.kept[i], self.tokens, self.seconds = k, tokens, seconds
            return True
        self.shapes[i] = self.items[i].shape(k + 1)
        return False

    def report(self, tpot_slo_s: float | None) -> TrimReport:
        offered = sum(len(chain) for chain in self.chains)
        # recomputed rather than the running sum, so rounding does not accumulate
        tokens = len(self.shapes) + sum(sum(chain[:k]) for chain, k in zip(self.chains, self.kept, strict=True))
        return TrimReport(offered, sum(self.kept), tokens, self.seconds, rate(tokens, self.seconds, self.gap_s),
                          fits(self.seconds, tpot_slo_s), self.predictions)


class ConfidenceTrim:
    name = "adaspec"

    def __init__(self, tpot_slo_s: float | None = None) -> None:
        self.tpot_slo_s = check_slo(tpot_slo_s)
        self.last: TrimReport | None = None
        self.calibrations: dict[str, AcceptanceCalibration] = {}  # per drafter id, the most recently heard last
        self.gap_s = 0.0  # moving average: one forward's end to the next one's start
        self._steps = 0

    def decide(self, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape]) -> dict[str, int]:
        self._steps += 1
        if self._steps % PROBE_EVERY == 0:  # a probe: verify every draft, so every draft is judged
            return {}
        calibrated = [dataclasses.replace(i, confidence=self._calibrated(i.drafter, i.confidence)) for i in items]
        return self.keep(calibrated, model, fixed, self.gap_s)

    def _calibrated(self, drafter: str, confidence: Sequence[float]) -> list[float]:
        cal = self.calibrations.get(drafter)
        return list(confidence) if cal is None else [cal.accept(c) for c in confidence]

    def observe_round(self, drafter: str, confidence: Sequence[float] | None, drafted: int, accepted: int) -> None:
        if not confidence or not drafted:
            return
        cal = self.calibrations.pop(drafter, None) or AcceptanceCalibration()
        self.calibrations[drafter] = cal
        cal.observe(confidence[:drafted], accepted)
        while len(self.calibrations) > MAX_CALIBRATIONS:  # drafters that left (a restart takes a new id)
            del self.calibrations[next(iter(self.calibrations))]

    def observe_gap(self, gap_s: float) -> None:
        if 0.0 <= gap_s < MAX_GAP_S:
            self.gap_s = gap_s if self.gap_s == 0.0 else ewma(self.gap_s, gap_s, GAP_ALPHA)

    def status(self) -> dict[str, Any]:
        """The acceptance by confidence bin, per drafter, and the gap."""
        return {"trim_calibration": {name: [round(r, 4) for r in cal.rate]
                                     for name, cal in sorted(self.calibrations.items())},
                "trim_gap_s": round(self.gap_s, 6)}

    def keep(
        self, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape] = (),
        gap_s: float = 0.0,
    ) -> dict[str, int]:
        check_items(items)
        if not items and not fixed:
            self.last = TrimReport(0, 0, 0.0, 0.0, 0.0, fits(0.0, self.tpot_slo_s), 0)
            return {}
        batch = _Batch.full(items, model, fixed, gap_s)
        self._eliminate(batch, model)
        self.last = batch.report(self.tpot_slo_s)
        return {item.session_id: k for item, k in zip(items, batch.kept, strict=True)}

    def _eliminate(self, batch: _Batch, model: StepTimeModel) -> None:
        """Alg. 2: candidates in ascending estimated acceptance; stop at the first kept one."""
        heap = batch.tails()
        heapq.heapify(heap)
        while heap:
            _, _, i = heapq.heappop(heap)
            if not batch.try_drop(i, model, self.tpot_slo_s):
                return
            if batch.kept[i] > 0:
                heapq.heappush(heap, batch.tail(i))
