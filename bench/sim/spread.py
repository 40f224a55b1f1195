"""Measured spread of a duration (``DrafterSpec.draft_spread``, ``send_spread``).

On this machine's shared edge core a drafter's batch or hand-off takes anywhere from a fraction
to several times its mean: the real drafters' round phases (``specfleet_drafter_round_phase_seconds``)
put a 4-token draft of draft-small at 2–20 ms and a send at 0.05–10 ms in one fairness run, where
the simulator would charge both the same every round. A :class:`Spread` holds such a histogram
and draws a factor of mean 1 from it (a bin by its count, then uniformly within it), so that the
simulator keeps each cost's calibrated mean and takes its shape from the run.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Spread:
    """Histogram bins (low, high, count) of a duration; :meth:`factor` draws value / mean."""

    bins: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        if not self.bins or any(not 0 <= lo <= hi or w < 0 for lo, hi, w in self.bins) or self.weight <= 0:
            raise ValueError(f"a spread needs bins with 0 <= low <= high and counts > 0 in all, got {self.bins}")
        if self.mean <= 0:
            raise ValueError("a spread's mean must be > 0")

    @cached_property
    def weight(self) -> float:
        return sum(w for _, _, w in self.bins)

    @cached_property
    def mean(self) -> float:
        return sum((lo + hi) / 2 * w for lo, hi, w in self.bins) / self.weight

    @cached_property
    def _cumulative(self) -> list[float]:
        """The bins' running counts (``random.choices``'s cum_weights), computed once."""
        return list(itertools.accumulate(w for _, _, w in self.bins))

    def factor(self, rng: random.Random) -> float:
        """One draw over the mean: on average 1."""
        lo, hi, _ = rng.choices(self.bins, cum_weights=self._cumulative)[0]
        return rng.uniform(lo, hi) / self.mean

    @classmethod
    def of_buckets(cls, buckets: Sequence[Sequence[float]], above: float = 0.0) -> Spread | None:
        """From a histogram's buckets, ``[upper bound, count]`` each in increasing order (as
        ``bench.run_stats`` records them), keeping those above ``above`` (a bucket's lower bound is
        the upper bound before it; an unbounded last one is taken as twice as wide as its lower
        bound). None when no observation is left."""
        bins, low = [], 0.0
        for upper, count in buckets:
            high = upper if math.isfinite(upper) else 2 * max(low, 1e-9)
            if count > 0 and high > above:
                bins.append((max(low, above), high, float(count)))
            low = high
        return cls(tuple(bins)) if bins else None


__all__ = ["Spread"]
