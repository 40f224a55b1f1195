"""Filling: decoding sessions target-only while their drafts travel, when that delays no draft.

A step with nothing to verify would leave the target idle until some draft arrives. It may instead
decode one token for each deterministic session that waits for a draft (``Request.fillable``:
greedy, or raced, ``shared.race``): the token that verifying the draft would have committed at
that position anyway, so the draft loses nothing (``requests``: the draft's leading tokens are
matched against the fill). Over a slow link this keeps speculation from falling below plain
decoding: the verifier decodes on while the drafter's round trip lasts. At 10 ms RTT, one
request: 650 tokens/s with filling against 300 without, greedy, and 433 against 206 at
temperature 1 (race sampling against stream sampling, which cannot fill), `python -m bench
profile --rtt-ms 10` (2026-11-26).

But a fill step takes time, and a draft that arrives during it waits for it. With many sessions
the next drafts are seldom far away, and filling every waiting session (a step as long as a
target-only step) delayed them enough to lose 7 % at 16 requests (2714 against 2917 tokens/s,
`python -m bench profile --concurrency 16 --requests 64`, with and without). So a fill step runs
only if it is predicted to end before the next draft is expected:

* each drafter's drafts take a typical time from the Verdict out to the Draft in: a moving average
  of its plain drafts' waits and of their deviation from it (conditional drafts, there before
  the round began, say nothing of it);
* a session waiting for a draft expects it as early as ``waiting_since + average - 2 deviations``;
  once that has passed it is imminent (expected now) until it is late, at twice the average, when
  it is expected no more. Nor is a draft that can add nothing: once the fill holds as many tokens
  as the round's budget, every token of the draft is settled already (over a slow link this lets
  the verifier decode on at target-only speed instead of waiting for a draft it cannot use). Nor is a
  session's first draft: the drafter first runs the whole prompt through its draft model (a GGUF
  copy on llama.cpp takes 5-10 ms a prompt token on a CPU), so the verifier decodes on meanwhile
  and the request's first token comes as fast as target-only serving's;
* the fill takes the sessions that waited longest, as many as the step-time estimator predicts to
  end before the earliest expected draft of any waiting session. A drafter never heard from yet
  expects nothing: its first round decodes on.

A step that verifies other sessions runs anyway, and a draft that arrives during it waits for it
whatever it holds. So such a step also takes every fillable session as a rider, longest waiting
first, as far as the batch limits allow (``Fill.riders``): a row costs far less than a step. Without
riders a session whose drafter is slow got no token at all while others were verified: with 16
requests and SmartSpec at budget 0 in 97 % of rounds, the few drafted rounds waited for catch-up
drafts and the fleet served 0.60x target-only (``python -m bench verifier-policies --parts
smartspec``, 2026-12-02). The simulator's verifier takes them too (``bench/sim/verifier.py``).

``FillBeforeDrafts`` is this policy; ``NeverFill`` (``--fill false``) is the baseline, a step with
nothing to verify waiting for a draft. Both sit behind ``Fill``, which the scheduler and the
simulator call.

With the average alone (no deviation, no budget test), `python -m bench rtt` (2026-11-26 09:06)
measured k = 4 at 0.80x target-only at 0 ms against 1.18x without filling (drafts arriving early
waited for fill steps), and 0.81x and 0.76x at 10 and 40 ms (against 0.38x and 0.14x without).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from services.verifier.batching.estimator import SegmentShape, StepTimeModel
from shared.calibration import ewma

#: weight of a new draft wait in a drafter's moving average
WAIT_ALPHA = 0.1
#: drafters remembered, those heard from least recently forgotten first
MAX_DRAFTERS = 4096


class Waiting(Protocol):
    """What the fill reads of a session (``requests.Request``; the simulator's sessions too)."""

    @property
    def waiting_draft(self) -> bool: ...  # its drafter owns the next move
    @property
    def fillable(self) -> bool: ...  # a step may decode it now
    @property
    def filled(self) -> int: ...  # tokens decoded for it while this round's draft travels
    @property
    def waiting_since(self) -> float: ...
    @property
    def first_round(self) -> bool: ...  # its drafter's first draft for it (after running the prompt)
    @property
    def drafter(self) -> str: ...
    @property
    def draft_budget(self) -> int: ...
    @property
    def cached(self) -> int: ...


W = TypeVar("W", bound=Waiting)


class Fill(Protocol):
    """What a step with nothing to verify decodes (``Scheduler._add_fill``)."""

    name: str

    def observe(self, drafter: str, wait_s: float) -> float | None:
        """A plain draft arrived ``wait_s`` after its round began waiting for it; returns how far that
        is from the drafter's typical wait (None: none known), for the metrics."""
        ...

    def choose(self, active: Sequence[W], estimator: StepTimeModel, now: float, limit: int) -> list[W]:
        """The sessions of ``active`` to decode one token each in a step starting ``now``, at most ``limit``."""
        ...

    def next_change(self, active: Sequence[Waiting], now: float) -> float | None:
        """Seconds until ``choose`` may choose differently with nothing else changed; None: never."""
        ...

    def riders(self, active: Sequence[W], limit: int) -> list[W]:
        """The sessions of ``active`` to decode one token each in a step that verifies others anyway,
        at most ``limit``."""
        ...


class NeverFill:
    """The baseline (``--fill false``): a step with nothing to verify waits for a draft."""

    name = "never"

    def observe(self, drafter: str, wait_s: float) -> float | None:
        return None

    def choose(self, active: Sequence[W], estimator: StepTimeModel, now: float, limit: int) -> list[W]:
        return []

    def next_change(self, active: Sequence[Waiting], now: float) -> float | None:
        return None

    def riders(self, active: Sequence[W], limit: int) -> list[W]:
        return []


def make_fill(fill: bool, riders: bool = True) -> Fill:
    """``--fill``: fill before the drafts come (the default), or never; ``--fill-riders``: in steps
    that verify others too (the default), or only in steps with nothing to verify."""
    return FillBeforeDrafts(riders) if fill else NeverFill()


class FillBeforeDrafts:
    """Fill as long as the step is predicted to end before the next draft is expected (module docstring)."""

    name = "before-drafts"

    def __init__(self, riders: bool = True) -> None:
        #: drafter -> (typical seconds from Verdict out to Draft in, typical deviation from that)
        self.waits: dict[str, tuple[float, float]] = {}
        self.take_riders = riders

    def observe(self, drafter: str, wait_s: float) -> float | None:
        """A plain draft arrived ``wait_s`` after its round began waiting for it. Returns how far
        that is from the drafter's typical wait so far (None: its first), what the deviation learns."""
        old = self.waits.pop(drafter, None)
        off = None
        if old is None:
            self.waits[drafter] = (wait_s, 0.0)
        else:
            mean, dev = old
            off = abs(wait_s - mean)
            self.waits[drafter] = (ewma(mean, wait_s, WAIT_ALPHA), ewma(dev, off, WAIT_ALPHA))
        while len(self.waits) > MAX_DRAFTERS:
            del self.waits[next(iter(self.waits))]
        return off

    def expected(self, req: Waiting, now: float) -> float | None:
        """The earliest ``req``'s draft is expected (perf_counter seconds); None when it is not
        (unknown, late, or it could add nothing to the fill)."""
        typical = self.waits.get(req.drafter)
        if typical is None or req.filled >= req.draft_budget or req.first_round:
            return None
        mean, dev = typical
        due = req.waiting_since + max(0.0, mean - 2 * dev)
        if now <= due:
            return due
        return now if now - req.waiting_since < 2 * mean else None

    def next_change(self, active: Sequence[Waiting], now: float) -> float | None:
        """Seconds until the next waiting session turns late (then it no longer holds fills back)."""
        lates = [r.waiting_since + 2 * typical[0] - now for r in active if r.waiting_draft and not r.first_round
                 and (typical := self.waits.get(r.drafter)) is not None and r.waiting_since + 2 * typical[0] > now]
        return min(lates, default=None)

    def choose(self, active: Sequence[W], estimator: StepTimeModel, now: float, limit: int) -> list[W]:
        """The fillable sessions of ``active`` to decode in a step starting ``now``, at most ``limit``."""
        dues = [due for r in active if r.waiting_draft and (due := self.expected(r, now)) is not None]
        first = min(dues, default=float("inf"))
        chosen: list[W] = []
        shapes: list[SegmentShape] = []
        for req in sorted((r for r in active if r.fillable), key=lambda r: r.waiting_since)[:limit]:
            shape = SegmentShape(new=1, cached=req.cached)
            if now + estimator.predict([*shapes, shape]) > first:
                break
            chosen.append(req)
            shapes.append(shape)
        return chosen

    def riders(self, active: Sequence[W], limit: int) -> list[W]:
        """Every fillable session, longest waiting first: a step that verifies others runs anyway,
        and a draft arriving during it waits for it whatever it holds, so a row for a waiting session
        delays no draft and costs only the row."""
        if not self.take_riders:
            return []
        return sorted((r for r in active if r.fillable), key=lambda r: r.waiting_since)[:max(0, limit)]
