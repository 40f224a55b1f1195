"""The verifier's engine core as the event loop sees it: commands in, results out.

The core owns the target model, the KV cache and every scheduling decision, and runs apart
from the event loop (the torch core on a thread of its own, as vLLM's EngineCore runs in a
process of its own), so the model never waits for network I/O. With ``--core-mode inline`` (or
``auto`` on one CPU) the torch core runs as a task on the event loop instead, yielding to I/O
after every step. The event loop side
(``server``, ``intake``, ``output``) validates frames, turns them into these commands, and
turns the core's results into wire messages.

A core implementation takes commands with :meth:`VerifierCore.submit` from the event loop
thread and hands back lists of results through the ``deliver`` callback it was built with;
results of one step arrive together, in order. ``deliver`` may be called from another thread:
the builder wraps it accordingly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.verifier.grammar import Grammar
from shared.draft_q import CheckedQ
from shared.protocol import FinishReason, SamplingParams, TokenLogprob

# --- commands (event loop -> core) ---------------------------------------------------------


@dataclass(frozen=True)
class Carried:
    """What a request brings from before it reached this verifier."""

    #: tokens already committed after the prompt (a request re-opened after its verifier was lost)
    generated: list[int] = field(default_factory=list)
    #: how long the request waited before it reached us: its ``arrived_at`` (the SLO clock, and the
    #: order of prefill and of prefix sharing, oldest first) is moved back by it
    waited_s: float = 0.0


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: bool  # wait for a drafter's drafts each round (else decode target-only)
    drafter: str = ""  # the drafter's node id, for per-drafter estimates and metrics
    slo_tokens_per_s: float | None = None  # the request's token-speed SLO class (None: the default)
    grammar: Grammar | None = None  # structured output: the request's grammar state
    carried: Carried = field(default_factory=Carried)  # what it brings from before it reached us

    @property
    def generated(self) -> list[int]:
        return self.carried.generated


@dataclass(frozen=True)
class DraftAsks:
    """What a drafter asks of the verifier with a draft."""

    pause_rounds: int = 0  # not to be waited for in the next this-many rounds (they run target-only)
    guess_bonus: bool = False  # to draw the bonus token by the keyed race (shared.coupling)


@dataclass(frozen=True)
class AddDraft:
    request_id: str
    round: int
    token_ids: list[int]
    q: list[CheckedQ] | None  # checked and parsed by intake
    received_at: float  # time.perf_counter() when the frame arrived
    confidence: list[float] | None = None  # the draft model's probability of each token (AdaSpec trim)
    asks: DraftAsks = field(default_factory=DraftAsks)
    #: a conditional draft (``Draft.after``): only if round ``round - 1`` commits exactly these tokens
    after: tuple[int, ...] | None = None
    drafting_s: float = 0.0  # the drafter's time drafting it (Draft.drafting_s; 0: not timed)
    ahead: bool = False  # a lookahead drafted it (Draft.ahead, or a conditional draft)


@dataclass(frozen=True)
class Detach:
    """The session's drafter is gone: decode it target-only from now on."""

    request_id: str


@dataclass(frozen=True)
class Finish:
    """Stop a session now (cancelled, or a stop string ended it); the core frees it silently."""

    request_id: str


@dataclass(frozen=True)
class Attach:
    """A drafter resumes a session that runs target-only: speculate again from its next round."""

    request_id: str
    drafter: str = ""


Command = AddRequest | AddDraft | Detach | Attach | Finish

# --- results (core -> event loop) ----------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """KV memory is reserved; the drafter may draft round 0 (the prompt is prefilled meanwhile)."""

    request_id: str
    draft_budget: int
    bonus_key: int | None = None  # shared.coupling; None: bonus tokens are not coupled
    race_key: int | None = None  # shared.race: the request's tokens are keyed races; None: not raced


@dataclass(frozen=True)
class RequestRefused:
    """The core cannot serve the request. ``code``: busy (retry later) or invalid (never)."""

    request_id: str
    code: str
    message: str


@dataclass(frozen=True)
class Committed:
    """What a round committed: ``tokens`` are the accepted drafts after ``prior`` (the tokens filled
    while the draft travelled), then the target's own token."""

    tokens: list[int]
    #: tokens this round committed earlier, while its draft was on its way (each already out as a
    #: ``Filled``): the round's Verdict carries them before ``tokens``
    prior: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens``, when the request asked


@dataclass(frozen=True)
class Ending:
    """Why a request ended with its round."""

    reason: FinishReason | None
    error: str = ""


@dataclass(frozen=True)
class Rounded:
    """One verified round, its tokens, the next round's budget, and the request's end if it ended."""

    request_id: str
    round: int
    drafted: int
    accepted: int
    committed: Committed
    draft_budget: int
    ending: Ending | None = None  # None: the request goes on

    @property
    def tokens(self) -> list[int]:
        return self.committed.tokens

    @property
    def prior(self) -> list[int]:
        return self.committed.prior

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.committed.logprobs

    @property
    def finished(self) -> bool:
        return self.ending is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.ending.reason if self.ending is not None else None

    @property
    def error(self) -> str:
        return self.ending.error if self.ending is not None else ""


@dataclass(frozen=True)
class Filled:
    """Tokens committed within a round still open (decoded while its draft travels): for the
    client now; the drafter hears of them with the round's ``Rounded``."""

    request_id: str
    round: int
    tokens: list[int]
    prior: list[int]  # the round's tokens filled before these
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class OutOfTurn:
    """A draft that does not belong to the session's current round (or to no session)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Detached:
    """The core gave up waiting for this session's drafter (silent too long)."""

    request_id: str


@dataclass(frozen=True)
class Attached:
    """A resumed session waits for a draft for ``round``, after ``generated`` committed tokens."""

    request_id: str
    generated: list[int]
    round: int
    draft_budget: int
    bonus_key: int | None = None  # shared.coupling; None: bonus tokens are not coupled
    race_key: int | None = None  # shared.race: the request's tokens are keyed races; None: not raced


Result = Admitted | RequestRefused | Rounded | Filled | OutOfTurn | Detached | Attached
Deliver = Callable[[list[Result]], None]


@dataclass
class KVStats:
    budget_bytes: int
    reserved_bytes: int
    cached_tokens: int
    sessions: int
    waiting: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class VerifierCore(Protocol):
    vocab_size: int
    max_model_len: int

    def start(self) -> None:
        """Begin serving (called on the running event loop)."""

    def submit(self, command: Command) -> None:
        """Queue a command (event loop thread); never blocks. Raises CoreBusy when the queue is full."""

    async def aclose(self) -> None:
        """Stop serving and wait for the core to wind down."""

    async def failed(self) -> None:
        """Wait while the core serves; raise :class:`CoreDied` if its loop stops on its own (an error
        in a step). The verifier then exits, so its supervisor restarts it and the coordinators
        re-open their requests there, rather than serving sockets while nothing steps."""

    # What the event loop reads of the core: a snapshot the core published (the torch core's runs
    # on another thread; the event loop never reads its live state).

    def kv_stats(self) -> KVStats: ...

    def status(self) -> dict[str, object]:
        """The policies and their estimates (``GET /status``)."""

    def draft_share(self) -> float:
        """The share of new requests that should go to drafters now (the draft-length policy's
        view, read from the event loop for the FleetStatus; see ``allocation.base.draft_share``)."""


class CoreBusy(RuntimeError):
    """The core's command queue is full: the verifier is overloaded; retry later."""


class CoreDied(RuntimeError):
    """The engine core's loop stopped with an error while the verifier was serving."""
