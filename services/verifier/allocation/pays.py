"""Speculation only while it measurably pays: the rate served against target-only's, on the clock.

SmartSpec (``smartspec.py``) picks each round's length from a model of goodput: the drafts'
acceptance, the verifier's step by shape, the edge's draft waits. The model can be wrong in ways
it cannot see. On an edge host whose one core runs two drafters, the coordinator and the clients,
llama.cpp drafts a 4-session batch in 4× a 1-session step's time (compute-bound: 45 against 11.5
ms for the Q4_1 copy), drafts arrive one after another, and the verifier runs a forward for each
few of them; the waits it measured at one length say nothing of another, and once they expire it
tries the longest length again. Measured on the default fleet (2026-12-02, the verifier on CPU 0,
the rest on CPU 1): its chosen length swung between 0 and 8 every few seconds, and the fleet
served 0.65-0.77× target-only's rate at 4 and 16 requests.

This guard checks the model against the clock, which counts everything: the drafting, the
network, the waits, the steps' overheads. Over each window of WINDOW_S seconds with speculation
on, it compares the tokens the verifier committed per second with what target-only decoding
would commit for the same sessions:

    served / target-only = (tokens / seconds) / (C / T0(C, L))

where C is the mean number of live sessions over the window, L their mean context, and T0 one
target-only step of C sessions: the forward the verifier measured (``shared.target_only_cost``,
from its start-up calibration and every one-token step) plus its own busy time between forwards
(``estimator.overhead``). The dashboard's "est. speedup" is this ratio on the model alone, read at
the coordinator (without the baseline below).

The verdict reads the windows since speculation last came on at that load, averaged (RATIO_WEIGHT),
so the first window decides alone and a later dip must outweigh the windows that paid before it.
Below THRESHOLD, speculation is switched off at that load: every session's budget is 0 (the
verifier decodes it without waiting for its drafter) and no new request is sent to a drafter
(``draft_share`` 0: a coordinator in ``--speculation auto`` opens them target-only). Each load band
of live sessions (1, 2-3, 4-7, ...) keeps its own verdict: on the default fleet speculation pays
1.6-1.9x for one request and loses at four. After a hold it is tried again for another window;
the hold doubles while the tries keep failing (HOLD_S up to MAX_HOLD_S) and halves after a window
that paid (the first window after a hold is a mix: requests opened while speculation was off stay
target-only to their end, so one paying window is weak evidence). With speculation on, the wrapped
policy decides as before (its own k = 0 included).

The model of target-only's rate misses what real target-only serving pays too: prefills, request
turnover, the steps' bookkeeping. Measured on the default fleet (2026-12-05, AVX512-BF16 host), the
ratio read 0.65-0.90 of the one measured against target-only serving, so at 4 requests, where the
fleet served 1.14-1.32x, it switched speculation off about half the runs (0.91x). So while a band
is off, its target-only serving is measured against the same model (``baseline``), and each later
verdict at that band divides by it: speculation is compared with target-only as it really runs.
Only windows that stay within the band count, not the first after a switch (its sessions were
still in the other regime), and the baseline is held within BASELINE_RANGE: a low one keeps a band
on, where it would not be measured again. The model's busy time between forwards follows the
regime it runs in (the last 512 steps), so the baseline also absorbs some of that shift. Nor is a
window judged in which the load moved two bands or more (``_Window.ramp``): at 64 requests the first
window held their prefills as they ramped up and read 0.69, before any baseline there, and switched
speculation off for its hold, where Fixed-S k = 4 served 1.18x target-only (2026-12-07, EPYC); a burst's
drain reads low too, and a band switched off there switches off every band above it.

``--speculation-guard false`` is the baseline: the wrapped policy alone, as the papers run it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from services.verifier.allocation.base import Allocator, RoundStats, draft_share
from services.verifier.allocation.draft_wait import band
from services.verifier.allocation.tracker import GoodputTracker

WINDOW_S = 2.5  # seconds of serving with speculation on that one verdict rests on
MIN_TOKENS = 48  # ... and at least this many tokens committed in them
THRESHOLD = 1.0  # served over target-only's rate below which speculation is switched off
HOLD_S = 8.0  # the first time off; doubled for each further window that did not pay
MAX_HOLD_S = 64.0
#: a step after a gap longer than this starts the window afresh: the verifier sat idle, with no
#: session to serve, which says nothing of speculation
IDLE_GAP_S = 1.0
#: the load a verdict applies to is the live sessions averaged over about this long: in a closed
#: loop the count dips each time a request ends and the next one has not arrived yet
LOAD_TAU_S = 1.0
#: weight of the newest target-only window in a band's ``baseline`` (an exponential average)
BASELINE_WEIGHT = 0.5
#: weight of the newest window in the ratio a verdict reads, over the windows since speculation came
#: on at the band: at 64 requests one window in five read 0.94-1.00 between windows of 1.22-1.37, as
#: requests ended and the next ones prefilled, and each such one switched speculation off for a hold
RATIO_WEIGHT = 0.5
#: what a baseline may read: measured 0.65-0.92 on the default fleet (2026-12-05); never above 1, so
#: the guard is never stricter than the model alone, and never so low that a window of prefills
#: could keep a losing band on
BASELINE_RANGE = (0.6, 1.0)

#: seconds of one target-only step of ``sessions`` sessions at ``context`` cached rows each (None: not known yet)
StepCost = Callable[[float, float], "float | None"]


@dataclass
class _Band:
    """What the guard knows of one load band (live sessions 1, 2-3, 4-7, ...)."""

    off_until: float = 0.0  # speculation is off at this load until then
    next_hold_s: float = HOLD_S
    ratio: float = float("nan")  # the last window's served over target-only
    #: the windows' ratios since speculation last came on here, averaged (RATIO_WEIGHT: the newest's
    #: weight; nan: none yet): what a verdict reads
    running: float = float("nan")
    switched_off: int = 0
    #: target-only serving's own rate over the model's, measured while off (nan: not yet)
    baseline: float = float("nan")

    @property
    def scale(self) -> float:
        """What a verdict divides by: the baseline within BASELINE_RANGE, or 1 (the model as it is)
        until it is measured."""
        if self.baseline != self.baseline:
            return 1.0
        return min(max(self.baseline, BASELINE_RANGE[0]), BASELINE_RANGE[1])


@dataclass
class _Window:
    """One window's sums: committed tokens, and sessions and context integrated over its seconds."""

    start: float
    last: float
    tokens: int = 0
    session_s: float = 0.0
    context_s: float = 0.0
    fewest: int = 1 << 30  # the fewest and most live sessions of its steps
    most: int = 0
    straddles: bool = False  # it began as speculation switched on or off: read, not used

    @property
    def ramp(self) -> bool:
        """The load moved two bands or more within it (1 to 4 sessions, 16 to 64, or back): a burst's
        prefills and first rounds, or its last requests draining, which target-only serving pays too,
        but which a window of steady target-only serving (the baseline) does not hold."""
        return band(self.most) - band(max(1, self.fewest)) >= 2

    @property
    def seconds(self) -> float:
        return self.last - self.start


def pays(tokens: int, seconds: float, mean_sessions: float, step_s: float) -> float:
    """Served tokens/s over target-only's C / T0 for the same mean sessions (``step_s`` = T0)."""
    if seconds <= 0 or mean_sessions <= 0 or step_s <= 0:
        return float("nan")
    return (tokens / seconds) / (mean_sessions / step_s)


class PaysGuard:
    """Wraps a draft-length policy (``Allocator``); switches speculation off while it does not pay,
    at the load where it did not: each load band of live sessions (1, 2-3, 4-7, ...: ``draft_wait.band``)
    keeps its own verdict and hold, since speculation that pays for one request may not for sixteen.
    A band switched off switches off every higher one too (more sessions make target-only's batch
    cheaper per token and the edge busier: speculation pays less), and the load is the live
    sessions' moving average (LOAD_TAU_S), so that a closed loop's dips between requests do not
    switch it back on.

    The engine core calls :meth:`served` after every step and the allocator methods as for any
    policy; the event loop reads :meth:`draft_share` and :meth:`beliefs` (reads only)."""

    def __init__(self, inner: Allocator, target_only: StepCost, clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S, threshold: float = THRESHOLD, hold_s: float = HOLD_S,
                 max_hold_s: float = MAX_HOLD_S) -> None:
        self.inner, self.name = inner, inner.name
        self.target_only, self.clock = target_only, clock
        self.window_s, self.threshold, self.hold_s, self.max_hold_s = window_s, threshold, hold_s, max_hold_s
        self.bands: dict[int, _Band] = {}  # replaced whole when one changes: the event loop reads it
        self.load = 0.0  # the live sessions' moving average
        self._last_step = 0.0
        self._window: _Window | None = None
        self._off_window: _Window | None = None  # target-only serving while off: the baseline
        self._was_on = True

    # --- the allocator interface -----------------------------------------------------------

    def on_at(self, sessions: float) -> bool:
        """Whether speculation is on with ``sessions`` live: no band up to theirs is switched off."""
        now, top = self.clock(), band(round(sessions))
        return all(now >= known.off_until for b, known in list(self.bands.items()) if b <= top)

    @property
    def on(self) -> bool:
        """On at the present load: the moving average, or none once no step has run for IDLE_GAP_S (the
        average is updated by steps, so an idle verifier's would still hold the last burst's load, and
        the first request after a burst would be opened target-only)."""
        idle = self.clock() - self._last_step > IDLE_GAP_S
        return self.on_at(0.0 if idle else self.load)

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        budget = self.inner.initial(session_id, tracker)
        return budget if self.on else 0

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        budgets = self.inner.assign(rounds, tracker)  # it learns from the rounds either way
        return budgets if self.on else dict.fromkeys(budgets, 0)

    def draft_share(self, tracker: GoodputTracker) -> float:
        """The wrapped policy's share, or none while speculation is off at the present load."""
        return draft_share(self.inner, tracker) if self.on else 0.0

    @property
    def last_k(self) -> int:
        return int(getattr(self.inner, "last_k", 0)) if self.on else 0

    @property
    def last_goodput(self) -> float:
        return float(getattr(self.inner, "last_goodput", 0.0))

    def beliefs(self) -> dict[str, float]:
        """The wrapped policy's beliefs, then per load band seen: the last window's served over
        target-only as measured there (``pays_ratio_band3``: 4-7 live sessions) and the windows' average
        since it came on there (``pays_running_band3``: what the verdict read), the seconds it stays
        off, and the baseline it divides by (1: not measured)."""
        inner = getattr(self.inner, "beliefs", None)
        out: dict[str, float] = dict(inner()) if callable(inner) else {}
        now = self.clock()
        out["pays_on"], out["pays_load"] = float(self.on), round(self.load, 2)
        for b, known in sorted(self.bands.items()):
            if known.ratio == known.ratio:  # a band only measured while off has no verdict (no NaN in JSON)
                out[f"pays_ratio_band{b}"] = round(known.ratio, 4)
            if known.running == known.running:
                out[f"pays_running_band{b}"] = round(known.running, 4)
            out[f"pays_off_left_s_band{b}"] = round(max(0.0, known.off_until - now), 3)
            out[f"pays_switched_off_band{b}"] = float(known.switched_off)
            out[f"pays_baseline_band{b}"] = round(known.scale, 4)
        return out

    # --- the measurement -------------------------------------------------------------------

    def served(self, sessions: int, committed: int, context: float) -> None:
        """One step of the verifier: ``sessions`` live, ``committed`` tokens committed by it, at a
        mean of ``context`` cached rows. Judges a full window while speculation is on, and measures
        target-only serving (the baseline) in one while it is off."""
        now = self.clock()
        self.load += (sessions - self.load) * min(1.0, (now - self._last_step) / LOAD_TAU_S)
        self._last_step = now
        on = self.on
        switched = on != self._was_on
        if sessions <= 0:
            self._window = self._off_window = None  # idle: the next windows start afresh
        elif on:
            self._off_window = None
            self._window = self._step(self._window, now, sessions, committed, context, self._judge, switched)
        else:  # off: the next window starts afresh; this one measures target-only serving
            self._window = None
            self._off_window = self._step(self._off_window, now, sessions, committed, context, self._measure,
                                          switched)
        self._was_on = self.on  # after this step's verdict

    def _step(self, w: _Window | None, now: float, sessions: int, committed: int, context: float,
              full: Callable[[_Window], None], switched: bool) -> _Window:
        """``w`` with one more step in it (a new window after a gap, or straddling a switch); ``full``
        reads it once it is full, unless it straddles."""
        if w is None or now - w.last > IDLE_GAP_S:
            return _Window(now, now, fewest=sessions, most=sessions, straddles=switched)
        dt = now - w.last
        w.last, w.tokens = now, w.tokens + committed
        w.session_s += sessions * dt
        w.context_s += sessions * context * dt
        w.fewest, w.most = min(w.fewest, sessions), max(w.most, sessions)
        if w.seconds >= self.window_s and w.tokens >= MIN_TOKENS:
            if not w.straddles:
                full(w)
            return _Window(now, now, fewest=sessions, most=sessions)
        return w

    def _ratio(self, w: _Window) -> float | None:
        """The window's served rate over the model of target-only's (None: its step not known yet)."""
        mean = w.session_s / w.seconds
        step_s = self.target_only(mean, w.context_s / w.session_s)
        return None if step_s is None else pays(w.tokens, w.seconds, mean, step_s)

    def _measure(self, w: _Window) -> None:
        """A full window of target-only serving (speculation off): the band's baseline."""
        ratio = self._ratio(w)
        b = band(w.most)
        if ratio is None or not ratio > 0 or band(w.fewest) != b:
            return  # no model yet, or a ramp across bands: not this band's target-only serving
        known = self.bands.get(b, _Band(next_hold_s=self.hold_s))
        was = known.baseline if known.baseline == known.baseline else ratio  # the first one as it is
        self.bands = {**self.bands, b: replace(known, baseline=was + BASELINE_WEIGHT * (ratio - was))}

    def _judge(self, w: _Window) -> None:
        raw = self._ratio(w)
        if raw is None or w.ramp:
            return  # target-only's step not measured yet: nothing to compare with; or a ramp (above)
        b = band(round(self.load))  # the load ``on`` reads: a window judged off turns it off at once
        known = self.bands.get(b, _Band(next_hold_s=self.hold_s))
        ratio = raw / known.scale  # against target-only serving as measured at this load, once it was
        was = known.running if known.running == known.running else ratio  # the first since it came on: as it is
        running = was + RATIO_WEIGHT * (ratio - was)
        if running >= self.threshold:
            known = replace(known, next_hold_s=max(self.hold_s, known.next_hold_s / 2), ratio=ratio,
                            running=running)
        else:
            known = replace(known, off_until=self.clock() + known.next_hold_s, ratio=ratio, running=float("nan"),
                            next_hold_s=min(self.max_hold_s, 2 * known.next_hold_s),
                            switched_off=known.switched_off + 1)
        self.bands = {**self.bands, b: known}
