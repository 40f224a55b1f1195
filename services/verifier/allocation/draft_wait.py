"""How long the verifier waits for an edge drafter's draft: SmartSpec's T_draft (eq. 4) when the
drafts are made at the edge.

The wait is drafting plus both network legs plus whatever else holds the edge: the drafter's
batch of other sessions' drafts, and on a shared edge host the coordinator and the clients,
whose work grows with the sessions in flight. So the wait of a k-token draft with n live
sessions is priced as

    wait(k, n) = level(band of n) + e1·k        (k = 0: no draft, no wait)

with e1 the per-token slope of a least-squares line through every recent wait, and the level
the mean wait (less e1·k) of the recent rounds whose live sessions fell in n's band (a power of
two: 1, 2-3, 4-7, ...), or the nearest band with BAND_MIN of them. One line for every load mixed
a burst's waits into a lone request's: at 48 requests/s a burst's 17-38 ms kept drafting off
for the single sessions between bursts, whose drafts take 5-7 ms, and those requests then rode
the next burst target-only. (A plane in k and n was tried too: its fit over a 2 s horizon of
bursty loads swung from 0 to 10 ms per session, and it drafted for fewer requests, 38-59 % at
36-64 requests/s.)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from services.verifier.batching.estimator import RecentLine

EDGE_WINDOW = 256  # recent rounds the draft waits are fitted on
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
    """The verifier's wait for a draft over the last ``window`` drafted rounds of the last
    ``horizon_s`` seconds (refitted every ``refit_every`` rounds, and as old ones expire): the
    line ``e0 + e1·k`` through all of them, and a level per load band (module docstring).

    A round whose draft was there before it began (a conditional draft that came true) waited 0 s
    and counts as such: the wait is the mean of a round's, and leaving those out would price
    every round as one whose lookahead missed. Waits expire after ``horizon_s``; with none
    measured since, :meth:`stale` says so and the caller assumes no wait, which lets speculation
    resume and measure it again."""

    def __init__(self, window: int = EDGE_WINDOW, refit_every: int = 16, horizon_s: float = WAIT_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(window, refit_every)
        self.horizon_s, self.clock = horizon_s, clock
        self._times: deque[float] = deque(maxlen=window)  # when each of ``points`` was measured
        self._loads: deque[float] = deque(maxlen=window)  # the live sessions then
        self.levels: dict[int, float] = {}  # load band -> its wait less e1·k

    def observe(self, x: float, y: float, sessions: float = 1.0) -> None:
        """One drafted round: ``x`` tokens drafted, ``y`` seconds waited, ``sessions`` live then."""
        if x > 0 and y >= 0 and sessions >= 0 and all(map(math.isfinite, (x, y, sessions))):
            self._times.append(self.clock())
            self._loads.append(sessions)
            super().observe(x, y)

    def expire(self) -> None:
        """Drop the waits measured more than ``horizon_s`` ago (the engine core's thread only)."""
        cutoff = self.clock() - self.horizon_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
            self._loads.popleft()
            self.points.popleft()
            self._since += 1  # a refit every ``refit_every`` changes, as for new points
        if not self.points:
            self.e0 = self.e1 = 0.0
            self.levels = {}
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
        """The wait for an ``x``-token draft with ``sessions`` live (None: over every load)."""
        if x <= 0:
            return 0.0
        levels = self.levels  # replaced whole by a refit: a read from the event loop sees one
        if sessions is None or not levels:
            return self.e0 + self.e1 * x
        b = band(sessions)
        return levels[min(levels, key=lambda c: (abs(c - b), c))] + self.e1 * x

    def _refit(self) -> None:
        super()._refit()
        sums: dict[int, list[float]] = {}
        for (x, y), n in zip(self.points, self._loads, strict=True):
            s = sums.setdefault(band(n), [0.0, 0.0])
            s[0] += 1
            s[1] += y - self.e1 * x
        self.levels = {b: max(0.0, total / count) for b, (count, total) in sums.items() if count >= BAND_MIN}


NO_WAIT = DraftWaitModel()  # what a stale wait is taken as (never observed: always 0)
