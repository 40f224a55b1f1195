"""How long the verifier waits for an edge drafter's draft: SmartSpec's T_draft (eq. 4) when the
drafts are made at the edge.

The wait is drafting plus both network legs plus whatever else holds the edge: the drafter's
batch of other sessions' drafts, and on a shared edge host the coordinator and the clients,
whose work grows with the sessions in flight. So the wait of a k-token draft with n live
sessions is priced as

    wait(k, n) = level(band of n) + slope·k        (k = 0: no draft, no wait)

over the recent rounds of each load band (live sessions 1, 2-3, 4-7, ...: a power of two),
BAND_WINDOW of them at most per band, so a burst's many rounds do not push the light loads'
few out. The slope is fitted within the bands (the load moves the level, not the slope: the
length SmartSpec picks moves with the load, and a slope across bands would take the load's
effect for the length's), and a band's level is its mean wait less slope·k. A load with no band
of BAND_MIN rounds takes the nearest band's level, the lighter of two equally near; with no
band at all, the line through every recent wait (``e0 + e1·k``).

One line for every load mixed a burst's waits into a lone request's: at 48 requests/s a burst's
17-38 ms kept drafting off for the single sessions between bursts, whose drafts take 5-7 ms,
and those requests then rode the next burst target-only. (A plane in k and n was tried too: its
least-squares slope in n swung from 0 to 10 ms per session over a 2 s horizon of bursty loads,
and it drafted for fewer requests, 38-59 % at 36-64 requests/s.)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from services.verifier.batching.estimator import RecentLine

EDGE_WINDOW = 256  # recent rounds the line over every load is fitted on
BAND_WINDOW = 64  # recent rounds each load band keeps
BAND_MIN = 8  # rounds a load band needs for a level of its own
#: draft waits older than this are forgotten: at 6 requests/s one burst raised the wait from
#: 6.6 to 13.9 ms, which switched speculation off, and with no drafted round since, nothing
#: would have lowered it again. Once they are gone, speculation is tried again; a shorter
#: horizon tries more often, which costs at high load
WAIT_HORIZON_S = 2.0


def band(sessions: float) -> int:
    """The load band of ``sessions`` live sessions: 0 for none, then 1, 2-3, 4-7, ... as 1, 2, 3, ..."""
    return max(0, int(sessions)).bit_length()


class DraftWaitModel(RecentLine):
    """The verifier's wait for a draft over the drafted rounds of the last ``horizon_s`` seconds
    (module docstring): the line ``e0 + e1·k`` through the last ``window`` of them, and per load
    band a level under one slope (``fit``) from the band's last ``band_window``, refitted every
    ``refit_every`` rounds and as old ones expire.

    A round whose draft was there before it began (a conditional draft that came true) waited 0 s
    and counts as such: the wait is the mean of a round's, and leaving those out would price
    every round as one whose lookahead missed. Waits expire after ``horizon_s``; with none
    measured since, :meth:`stale` says so and the caller assumes no wait, which lets speculation
    resume and measure it again.

    The engine core's thread observes, expires and refits; the event loop reads ``predict`` and
    ``stale``. ``fit`` is replaced whole, so a read sees one fit."""

    def __init__(self, window: int = EDGE_WINDOW, refit_every: int = 16, horizon_s: float = WAIT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic, band_window: int = BAND_WINDOW) -> None:
        super().__init__(window, refit_every)
        self.horizon_s, self.clock, self.band_window = horizon_s, clock, band_window
        self._times: deque[float] = deque(maxlen=window)  # when each of ``points`` was measured
        self._bands: dict[int, deque[tuple[float, float, float]]] = {}  # band -> (when, k, wait s)
        self.fit: tuple[float, dict[int, float]] = (0.0, {})  # (slope within bands, level per band)

    def observe(self, x: float, y: float, sessions: float = 1.0) -> None:
        """One drafted round: ``x`` tokens drafted, ``y`` seconds waited, ``sessions`` live then."""
        if x > 0 and y >= 0 and sessions >= 0 and all(map(math.isfinite, (x, y, sessions))):
            now = self.clock()
            self._times.append(now)
            self._bands.setdefault(band(sessions), deque(maxlen=self.band_window)).append((now, x, y))
            super().observe(x, y)

    def expire(self) -> None:
        """Drop the waits measured more than ``horizon_s`` ago (the engine core's thread only)."""
        cutoff = self.clock() - self.horizon_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
            self.points.popleft()
            self._since += 1  # a refit every ``refit_every`` changes, as for new points
        for b, rounds in list(self._bands.items()):
            while rounds and rounds[0][0] < cutoff:
                rounds.popleft()
            if not rounds:
                del self._bands[b]
        if not self.points:
            self.e0 = self.e1 = 0.0
            self.fit = (0.0, {})
        elif self._since >= self.refit_every:
            self._since = 0
            self._refit()

    def stale(self) -> bool:
        """No wait measured in the last ``horizon_s`` (a read: safe from the event loop)."""
        try:
            return self._times[-1] < self.clock() - self.horizon_s
        except IndexError:  # none at all
            return True

    def predict(self, x: float, sessions: float | None = None) -> float:
        """The wait for an ``x``-token draft with ``sessions`` live (None: the line over every load)."""
        if x <= 0:
            return 0.0
        slope, levels = self.fit
        if sessions is None or not levels:
            return self.e0 + self.e1 * x
        b = band(sessions)
        return levels[min(levels, key=lambda c: (abs(c - b), c))] + slope * x

    def _refit(self) -> None:
        super()._refit()
        # a band's deque is never empty: observe appends to it, and expire drops it once emptied
        means = {b: (len(r), sum(k for _, k, _ in r) / len(r), sum(y for _, _, y in r) / len(r))
                 for b, r in self._bands.items()}
        sxx = sum((k - means[b][1]) ** 2 for b, r in self._bands.items() for _, k, _ in r)
        sxy = sum((k - means[b][1]) * (y - means[b][2]) for b, r in self._bands.items() for _, k, y in r)
        slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        self.fit = (slope, {b: max(0.0, my - slope * mk) for b, (n, mk, my) in means.items() if n >= BAND_MIN})


NO_WAIT = DraftWaitModel()  # what a stale wait is taken as (never observed: always 0)
