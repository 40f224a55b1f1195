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

**Timed by the drafter** (``Draft.drafting_s``, ``Draft.ahead``). SmartSpec uses one length for
every session, so its rounds rarely differ in length and the slope above reads 0: a shorter draft
then looks no quicker to come, and the longest wins. And a drafter that pipelines drafts the next
round while this one is verified (a *lookahead*), so a draft that takes less time than the
verification costs no wait at all. At T = 1 on the Q4_1 copy (bench profile, one request): k = 8
waited for every draft (no lookahead was in time) and gave 74.9 tokens/s; k = 4, 88.0, with 85
of 166 lookaheads at the verifier before their round. So when a band's drafts carry the
drafter's own drafting time, the wait is priced from its parts instead:

    fresh(k) = net + d·k                            (drafting d per token, the rest net)
    ahead(k) = max(0, d·(k + 1) − verify − rest)    (a lookahead drafts k + 1 from when the draft
                                                     left, while the round is verified: ``head_start``)
    wait(k)  = (1 − P)·fresh(k) + P·ahead(k),   P = π·α^k

d is Σ drafting time / Σ drafted over the band's fresh drafts, net their mean wait beyond their
drafting, and π the share of the rounds after a fully accepted one whose draft came from a
lookahead (the drafter pipelined, and guessed the bonus token). α^k is the chance the round's
draft is accepted whole, which a lookahead needs. ``rest`` is what a round takes beyond its wait
and its verification as priced (the session's time between rounds, less both: the event loops,
the Verdict's way out); SmartSpec adds it to a speculating round's time too.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from services.verifier.batching.estimator import RecentLine

EDGE_WINDOW = 256  # recent rounds the line over every load is fitted on
BAND_WINDOW = 64  # recent rounds each load band keeps
BAND_MIN = 8  # rounds a load band needs for a level of its own
#: draft waits older than this are forgotten: at 6 requests/s one burst raised the wait from
#: 6.6 to 13.9 ms, which switched speculation off, and with no drafted round since, nothing
#: would have lowered it again. Once they are gone, speculation is tried again; a shorter
#: horizon tries more often, which costs at high load
WAIT_HORIZON_S = 2.0
#: the drafter-timed parts (:class:`Timed`) are fitted over this long: a drafter's speed and its
#: lookaheads' share move with its edge's load (the bands) more than with time, and at one request
#: each of the default fleet's two drafters serves every other request, so within WAIT_HORIZON_S
#: it rarely had BAND_MIN fresh drafts (a lookahead's draft is not a fresh one)
TIMED_HORIZON_S = 30.0


@dataclass(frozen=True, slots=True)
class Timed:
    """A load band's wait in parts (module docstring): ``net`` s beyond drafting, ``per_token`` s of
    drafting per token, and ``ahead`` (π) the share of rounds after a fully accepted one that a
    lookahead drafted."""

    net: float
    per_token: float
    ahead: float
    rest: float = 0.0  # a round's time beyond its wait and its priced verification (see WaitSample.rest)

    def wait(self, k: float, alpha: float, head_start: float) -> float:
        """The mean wait for a k-token draft when each draft is accepted with ``alpha`` and a
        lookahead has ``head_start`` s (the round's priced verification) and ``rest`` before its
        round begins."""
        fresh = self.net + self.per_token * k
        p = self.ahead * min(1.0, max(0.0, alpha)) ** k
        return (1.0 - p) * fresh + p * max(0.0, self.per_token * (k + 1) - head_start - self.rest)


@dataclass(frozen=True, slots=True)
class WaitSample:
    """One drafted round's wait: ``k`` drafted, ``wait`` s, and the drafter's own timing of it."""

    when: float
    k: float
    wait: float
    drafting_s: float = 0.0  # the drafter's forwards for it (0: not timed)
    ahead: bool = False  # drafted by a lookahead, during the previous round's verification
    after_full: bool = False  # the session's previous round accepted its whole draft
    #: the round's time beyond its wait and its verification (as the core measured it, draft in to
    #: verdict, else as priced): the Verdict's way out, the draft's way into the core; None: not measured
    rest: float | None = None


def timed_fit(rounds: deque[WaitSample] | list[WaitSample]) -> Timed | None:
    """A band's :class:`Timed` parts; None with fewer than BAND_MIN timed fresh drafts."""
    fresh = [r for r in rounds if not r.ahead and r.drafting_s > 0]
    if len(fresh) < BAND_MIN:
        return None
    per_token = sum(r.drafting_s for r in fresh) / sum(r.k for r in fresh)
    net = sum(max(0.0, r.wait - r.drafting_s) for r in fresh) / len(fresh)
    after = [r for r in rounds if r.after_full]
    ahead = sum(r.ahead for r in after) / len(after) if after else 0.0
    rests = [r.rest for r in rounds if r.rest is not None]
    return Timed(net, per_token, ahead, max(0.0, sum(rests) / len(rests)) if rests else 0.0)


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
        #: each band's last ``band_window`` rounds, over TIMED_HORIZON_S (``_bands``: those of ``horizon_s``)
        self._rounds: dict[int, deque[WaitSample]] = {}
        self.fit: tuple[float, dict[int, float]] = (0.0, {})  # (slope within bands, level per band)
        self.timed: dict[int, Timed] = {}  # per band with enough drafts the drafter timed: the parts

    def observe(self, x: float, y: float, sessions: float = 1.0, drafting_s: float = 0.0, ahead: bool = False,
                after_full: bool = False, rest_s: float | None = None) -> None:
        """One drafted round: ``x`` tokens drafted, ``y`` seconds waited, ``sessions`` live then;
        ``drafting_s`` the drafter's time for it, ``ahead`` whether a lookahead drafted it, and
        ``after_full`` whether the session's previous round accepted its whole draft, ``rest_s``
        the round's time beyond its wait and its priced verification (:class:`WaitSample`)."""
        if x > 0 and y >= 0 and sessions >= 0 and all(map(math.isfinite, (x, y, sessions, drafting_s))):
            now = self.clock()
            self._times.append(now)
            rest = rest_s if rest_s is not None and math.isfinite(rest_s) else None
            sample = WaitSample(now, x, y, max(0.0, drafting_s), ahead, after_full, rest)
            self._rounds.setdefault(band(sessions), deque(maxlen=self.band_window)).append(sample)
            super().observe(x, y)

    def expire(self) -> None:
        """Drop the waits measured more than ``horizon_s`` ago, and the rounds the timed parts rest on
        after TIMED_HORIZON_S (the engine core's thread only)."""
        now = self.clock()
        cutoff = now - self.horizon_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
            self.points.popleft()
            self._since += 1  # a refit every ``refit_every`` changes, as for new points
        _expire(self._rounds, now - max(self.horizon_s, TIMED_HORIZON_S))
        if not self.points:
            self.e0 = self.e1 = 0.0
            self.fit, self.timed = (0.0, {}), {}
        elif self._since >= self.refit_every:
            self._since = 0
            self._refit()

    def rest(self, sessions: float) -> float:
        """The round's time the prices leave out (:class:`Timed`), while the timed parts price the
        waits for ``sessions`` live (:meth:`predict`); else 0."""
        if not self.timed or not self.fit[1]:
            return 0.0
        return self.timed[nearest(self.timed, band(sessions))].rest

    def timing(self) -> bool:
        """The drafter times its drafts, but too few fresh ones yet to price its waits by (no
        :class:`Timed` band): the slope in k is then unknown."""
        return not self.timed and any(s.drafting_s > 0 for r in self._rounds.values() for s in r)

    def stale(self) -> bool:
        """No wait measured in the last ``horizon_s`` (a read: safe from the event loop)."""
        try:
            return self._times[-1] < self.clock() - self.horizon_s
        except IndexError:  # none at all
            return True

    def predict(self, x: float, sessions: float | None = None, alpha: float | None = None,
                head_start: float = 0.0) -> float:
        """The wait for an ``x``-token draft with ``sessions`` live (None: the line over every load).
        With ``alpha`` and a band the drafter timed, priced from its parts (:class:`Timed`), a
        lookahead having ``head_start`` s."""
        if x <= 0:
            return 0.0
        slope, levels = self.fit
        if sessions is None or not levels:
            return self.e0 + self.e1 * x
        b = band(sessions)
        if alpha is not None and self.timed:
            return self.timed[nearest(self.timed, b)].wait(x, alpha, head_start)
        return levels[nearest(levels, b)] + slope * x

    @property
    def _bands(self) -> dict[int, list[WaitSample]]:
        """Each band's rounds of the last ``horizon_s`` (the bands with any)."""
        cutoff = self.clock() - self.horizon_s
        recent = {b: [s for s in r if s.when >= cutoff] for b, r in self._rounds.items()}
        return {b: r for b, r in recent.items() if r}

    def _refit(self) -> None:
        super()._refit()
        bands = self._bands
        means = {b: (len(r), sum(s.k for s in r) / len(r), sum(s.wait for s in r) / len(r)) for b, r in bands.items()}
        sxx = sum((s.k - means[b][1]) ** 2 for b, r in bands.items() for s in r)
        sxy = sum((s.k - means[b][1]) * (s.wait - means[b][2]) for b, r in bands.items() for s in r)
        slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        self.fit = (slope, {b: max(0.0, my - slope * mk) for b, (n, mk, my) in means.items() if n >= BAND_MIN})
        timed = {b: timed_fit(r) for b, r in self._rounds.items()}
        self.timed = {b: t for b, t in timed.items() if t is not None}


def _expire(bands: dict[int, deque[WaitSample]], cutoff: float) -> None:
    """Drop the samples older than ``cutoff``, and the bands left empty."""
    for b, rounds in list(bands.items()):
        while rounds and rounds[0].when < cutoff:
            rounds.popleft()
        if not rounds:
            del bands[b]


def nearest(bands: Mapping[int, object], b: int) -> int:
    """The band of ``bands`` nearest to ``b``, the lighter of two equally near."""
    return min(bands, key=lambda c: (abs(c - b), c))


NO_WAIT = DraftWaitModel()  # what a stale wait is taken as (never observed: always 0)
