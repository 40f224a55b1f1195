"""Arrival traces: Poisson, and bursty patterns shaped like AdaSpec's Fig. 1 (seeded).

AdaSpec (adaspec.txt §2, Fig. 1) replays three production traces (BurstGPT, Mooncake):

1. ``varying``: large minute-level swings of the request rate (here: a step between a low and a
   high phase, compressed to the length of a benchmark);
2. ``periodic``: high-frequency periodic oscillation, batch-style arrivals (a square wave);
3. ``oscillating``: rapid fluctuation around a central value (a rate redrawn every short slot).

The traces themselves are not available offline, so each pattern is a non-homogeneous Poisson
process with that shape and the given mean rate, drawn by thinning: candidate arrivals at the
peak rate, each kept with probability rate(t) / peak.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from bench.client import poisson_arrivals

TRACES = ("poisson", "varying", "periodic", "oscillating")

RateFn = Callable[[float], float]


def _shape(kind: str, mean: float, period_s: float, rng: random.Random) -> tuple[RateFn, float]:
    """The rate function of ``kind`` with mean ``mean``, and its peak."""
    if kind == "poisson":
        return (lambda t: mean), mean
    if kind == "varying":  # a quarter of the time at 2.5x the mean, the rest at 0.5x
        return (lambda t: 2.5 * mean if (t / period_s) % 1.0 < 0.25 else 0.5 * mean), 2.5 * mean
    if kind == "periodic":  # bursts: 1.8x for half of each short period, 0.2x for the other half
        short = period_s / 8
        return (lambda t: 1.8 * mean if (t / short) % 1.0 < 0.5 else 0.2 * mean), 1.8 * mean
    if kind == "oscillating":  # a rate redrawn uniformly in [0.4, 1.6] x mean every slot
        slot = period_s / 40
        levels: dict[int, float] = {}

        def rate(t: float) -> float:
            i = int(t / slot)
            if i not in levels:
                levels[i] = mean * (0.4 + 1.2 * rng.random())
            return levels[i]
        return rate, 1.6 * mean
    raise ValueError(f"unknown trace {kind!r}; choose one of {', '.join(TRACES)}")


def trace_arrivals(kind: str, mean_rate: float, n: int, seed: int = 0, period_s: float = 0.0) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests of a ``kind`` trace at
    ``mean_rate`` requests/s on average; ``period_s`` is the pattern's period (default: the
    time ``n`` requests take at the mean rate, so every run sees the whole shape once)."""
    if mean_rate <= 0 or n < 0:
        raise ValueError("a trace needs a mean rate > 0 requests/s and n >= 0 requests")
    if kind == "poisson":
        return poisson_arrivals(mean_rate, n, seed)
    rng = random.Random(seed)
    rate, peak = _shape(kind, mean_rate, period_s or max(n / mean_rate, 1e-3), random.Random(seed + 1))
    t, out = 0.0, list[float]()
    while len(out) < n:
        t += rng.expovariate(peak)
        if rng.random() * peak <= rate(t):
            out.append(t)
    return out


def rate_profile(arrivals: list[float], bins: int = 20) -> list[float]:
    """Requests per second in ``bins`` equal slices of the trace (for plots and tests)."""
    if not arrivals:
        return []
    width = max(arrivals) / bins or 1.0
    counts = [0] * bins
    for t in arrivals:
        counts[min(bins - 1, math.floor(t / width))] += 1
    return [c / width for c in counts]
