"""The simulator's mutable state: the event queue, the sessions (requests) and the drafters."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from bench.sim.spread import Spread
from services.drafter.control import ControlSettings, DraftController


class Kind(IntEnum):
    """What happens at an event (its payload in brackets)."""

    ARRIVE = 0  # a request arrives at its drafter/client [Edge]
    OPEN = 1  # the session's open message reaches the verifier [Session]
    VERDICT = 2  # a verdict (or the admission) reaches the drafter [Verdict]
    DRAFT_DONE = 3  # the draft model finished a batch of drafts [(Edge, tuple of Sessions)]
    DRAFT_IN = 4  # a draft reaches the verifier [Session]
    STEP_END = 5  # the verifier's forward pass finished [Step]
    LOOKAHEAD_STEP = 6  # one token of each running lookahead drafted [(Edge, tuple of (Session, Lookahead))]
    WAKE = 7  # the verifier looks again whether it may fill (a waiting session's draft turned late) [None]
    CONDITIONAL_IN = 8  # a lookahead sent before the verdict it assumes reaches the verifier [(Session, Lookahead)]
    EDGE_CPU = 9  # the next job on the drafters' shared cores may end (edge_cpu.py) [version]


class Events:
    """A heap of (time, sequence, kind, payload): time order, ties in scheduling order (deterministic)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Kind, Any]] = []
        self._seq = itertools.count()

    def push(self, at: float, kind: Kind, payload: Any) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def pop(self) -> tuple[float, Kind, Any]:
        at, _, kind, payload = heapq.heappop(self._heap)
        return at, kind, payload

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(slots=True, eq=False)
class Session:
    """One request, as both ends see it (the simulator knows both)."""

    sid: str
    edge: Edge
    prompt_len: int
    max_tokens: int
    slo: float | None
    arrived_at: float  # at the client: latency, TTFT and the SLO clock start here
    controller: DraftController | None
    speculative: bool = True  # False: opened target-only (no drafter ever hears of it)
    opened_at: float = 0.0  # at the verifier (a real request's arrived_at is moved back to its take: arrived_at)
    prefilled: bool = False  # whether its drafter has run its prompt through the draft model
    generated: int = 0
    cached: int = 0  # KV rows the verifier holds for it
    budget: int = 0  # draft budget of the current round
    asked: int = 0  # draft tokens this round asked its proposer for (its drafts: as many, or fewer if it ran out)
    drafts: list[tuple[float, bool]] = field(default_factory=list)  # this round's (accept prob, accepted)
    draft_s: float = 0.0  # draft model time of this round's draft
    sent_at: float = 0.0  # when the drafter sent this round's draft
    awaiting: bool = False  # its draft (maybe empty) was sent; its drafter has not started its next round
    waiting_since: float = 0.0  # when the verifier began waiting for this round's draft
    waiting_draft: bool = False  # the verifier waits for this round's draft (it may fill meanwhile)
    filled: int = 0  # tokens the verifier decoded for it while this round's draft travelled
    matched: int = 0  # of this round's drafts, the leading ones the fill had committed already
    sent: int = 0  # drafts its drafter sent for this round (before the fill settled some)
    draft_wait_s: float = 0.0
    first_token_at: float | None = None  # first output token back at the client
    finished: bool = False
    ahead: Lookahead | None = None  # its draft of the next round, drafted while this one is verified
    round: int = 0  # the verifier's: the round it works on (each verdict it sends ends one)
    drafter_round: int = 0  # the drafter's: the round of the draft it sent last (the verdict it awaits)
    upcoming: Lookahead | None = None  # a conditional draft the verifier holds for the next round
    fill_broke: int = -1  # the last round whose fill left its draft (its lookahead cannot come true)

    @property
    def first_round(self) -> bool:
        return self.round == 0

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.generated

    # what the verifier's fill policy reads (services.verifier.fill.Waiting)
    @property
    def fillable(self) -> bool:
        """Waiting for a draft with its context cached but the last token (a real request's
        ``to_prefill == 0``): the simulator feeds a prompt with the first round, never in a fill."""
        return self.waiting_draft and not self.finished and self.cached == self.context_len - 1

    @property
    def drafter(self) -> str:
        return self.edge.name

    @property
    def draft_budget(self) -> int:
        return self.budget

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated


@dataclass(slots=True, eq=False)
class Lookahead:
    """A pipelined draft of a session's next round (``services/drafter/lookahead.py``): its guess of
    the verifier's bonus token, then ``tokens`` drafts, drafted one token per batch of the draft
    model, after any ready round. Whether the verdict will make it the next draft is known when
    it starts: the simulator has drawn the round's outcomes (every draft accepted, and the guess
    right). Done before its verdict came, it goes to the verifier as a conditional draft
    (``DrafterSpec.conditional``), which takes it when the round it assumes ends as it assumed."""

    hit: bool
    tokens: int  # draft tokens it asks its proposer for, for the next round (as many as this round asked)
    left: int  # tokens still to draft (the guess included)
    round: int = 0  # the round whose verdict it assumes (it drafts round + 1)
    wanted: bool = False  # the verdict came and takes it, once done
    #: done before its verdict came: its drafts (accept prob, accepted), drawn then; sent to the
    #: verifier as a conditional draft (``sent``) unless empty, and cut to the next round's budget there
    drafts: list[tuple[float, bool]] | None = None
    sent: bool = False

    def draft(self, budget: int) -> list[tuple[float, bool]]:
        """What the verifier verifies of a conditional draft in a round of ``budget``."""
        return (self.drafts or [])[: max(0, budget)]


@dataclass(slots=True, eq=False)
class Edge:
    """One drafter: its draft model (busy or not), the sessions ready for it (oldest first), its counters."""

    index: int
    name: str
    alpha: float
    token_s: float
    round_s: float
    prefill_token_s: float
    send_s: float
    half_rtt: float
    max_batch: int  # sessions drafted together at most
    pipeline_sessions: int  # sessions draft lookaheads while this drafter serves at most this many
    lookahead_token_s: float  # draft-model seconds per lookahead token (0: a forward's share)
    proposal_rate: float  # the chance its proposer has each next draft token (DrafterSpec.proposal_rate)
    settings: ControlSettings  # one per drafter: the controllers of its sessions share its state
    forward_s: float = 0.0  # draft-model fixed seconds per forward of a batch (DrafterSpec.forward_s)
    conditional: bool = False  # a lookahead done before its verdict goes out as a conditional draft
    jitter_s: float = 0.0  # uniform extra one-way delay of each draft and verdict (DrafterSpec.jitter_s)
    draft_spread: Spread | None = None  # of its round batches' draft-model time (DrafterSpec.draft_spread)
    send_spread: Spread | None = None  # of its drafts' hand-off (DrafterSpec.send_spread)
    send_rows: float = 0.0  # a round batch's drafts leave one after another (DrafterSpec.send_rows)
    last_up: float = 0.0  # when its last draft arrives at the verifier (a later one never overtakes it)
    last_down: float = 0.0  # when its last verdict arrives here
    queue: deque[Session] = field(default_factory=deque)
    in_flight: list[Session] = field(default_factory=list)  # drafts sent, verdict not yet back
    looking: list[Session] = field(default_factory=list)  # sessions whose lookahead is being drafted
    busy: bool = False
    requests: int = 0  # requests started
    scheduled: int = 0  # requests due to start (their ARRIVE events pending)
    live: int = 0  # requests started and not finished

    def carry(self, leaves: float, up: bool, rng: random.Random) -> float:
        """When a message between this drafter and the verifier that leaves at ``leaves`` arrives
        (``up``: a draft, else a verdict): half the RTT later, plus a uniform jitter in [0,
        ``jitter_s``], never before the one before it in its direction (one connection, as
        through the delay proxy; so is a draft whose hand-off took longer than the next one's)."""
        if not self.jitter_s and self.send_spread is None:
            return leaves + self.half_rtt
        at = leaves + self.half_rtt + (rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)
        if up:
            at = self.last_up = max(self.last_up, at)
        else:
            at = self.last_down = max(self.last_down, at)
        return at

    def send_after(self, rng: random.Random) -> float:
        """This draft's hand-off: ``send_s``, times a draw of ``send_spread`` if any."""
        return self.send_s * self.send_spread.factor(rng) if self.send_spread is not None else self.send_s

    def batch_send_after(self, i: int, rng: random.Random) -> float:
        """The hand-off of the ``i``-th draft (from 0) of a round batch: with ``send_rows``, one after
        another, ``i + 1`` hand-offs of 2·send_s/(send_rows + 1) each (so at batches of ``send_rows``
        sessions their mean is ``send_s``, as measured); else ``send_after``."""
        share = 2.0 * (i + 1) / (self.send_rows + 1.0) if self.send_rows > 0 else 1.0
        return self.send_after(rng) * share

    def batch_factor(self, rng: random.Random) -> float:
        """A round batch's draft-model time over its mean: a draw of ``draft_spread``, else 1."""
        return self.draft_spread.factor(rng) if self.draft_spread is not None else 1.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verdict travelling to the drafter: the round just verified and the next one's budget."""

    session: Session
    drafted: int
    accepted: int
    finished: bool
    budget: int
    round: int = -1  # the round it ends (-1: the admission, before round 0)


@dataclass(frozen=True, slots=True)
class Step:
    """A forward pass in flight: the sessions verified and what choosing them cost (wall clock)."""

    sessions: tuple[Session, ...]
    seconds: float
    select_s: float
    fill: bool = False  # a fill step: one target-only token for each, while their drafts travel
    #: waiting sessions decoded one token each in a step that verifies the others (``Fill.riders``)
    riders: tuple[Session, ...] = ()
