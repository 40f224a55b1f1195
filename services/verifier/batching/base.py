"""Batch selection: which ready sessions go into the next verification pass.

Policies: FCFS (``fcfs.py``, the baseline) and WISP's SLO-aware batching (``wisp.py``: EDF
for sessions past their latest start, then utility density, checked against memory and
deadlines).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SloClock:
    """A request's token-speed clock: when it arrived, what it has generated since, its target."""

    arrived_at: float = 0.0  # when the request arrived: its token-speed clock starts here
    generated: int = 0  # output tokens committed so far
    slo_tokens_per_s: float | None = None  # its SLO class's token-speed target; None = best effort


@dataclass(frozen=True)
class Candidate:
    """A session that is ready to be verified, with what a policy may weigh it by.

    All times are ``time.perf_counter()`` seconds. The fields after ``ready_since`` have
    defaults so a bare candidate (FCFS needs no more) stays valid; WISP reads them all
    (wisp.txt §4.2: each request carries N̂_v, a memory footprint m̂ and a deadline).
    """

    session_id: str
    new_tokens: int  # L_new: tokens fed this round (uncached committed ones, at least the last, + drafts)
    context_len: int  # committed tokens (prompt + generated)
    ready_since: float  # when it became ready (its queue wait starts)
    cached: int = 0  # L_cached: KV rows the session already holds
    clock: SloClock = field(default_factory=SloClock)  # its token-speed clock (WISP's deadline)
    expected_tokens: float = 1.0  # N̂_v: tokens this round is expected to commit (accepted drafts + 1)
    kv_tokens: int = 0  # extra KV rows the round needs (0 when already reserved)


@dataclass(frozen=True)
class BatchLimits:
    max_sessions: int
    max_tokens: int


class BatchPolicy(Protocol):
    name: str

    def select(self, ready: Sequence[Candidate], limits: BatchLimits) -> list[str]:
        """Session ids to verify together now (non-empty whenever ``ready`` is), in admission order."""

    def riders_fit(self, cached: Sequence[int]) -> int:
        """How many riders the last selected batch takes: sessions decoded one token each in the same
        step (``Scheduler._add_riders``), ``cached`` their KV rows, in the order offered."""


def slo_met(arrived_at: float, generated: float, slo_tokens_per_s: float | None, now: float) -> bool:
    """Whether a request that arrived at ``arrived_at`` and has committed ``generated`` output tokens
    by ``now`` meets its token-speed SLO: generated / (now − arrived_at) ≥ target (wisp.txt §3.1
    eq. 4 over the whole stream, §5.1: a violation is an achieved speed below the class target).

    No target (``None`` or ≤ 0) is always met, and so is any request before time has passed.
    """
    if slo_tokens_per_s is None or slo_tokens_per_s <= 0:
        return True
    return generated >= slo_tokens_per_s * (now - arrived_at)
