"""Per-session state inside the engine core: one ``Request`` per session, with a status enum.

    WAITING        admitted by the event loop, waiting for KV memory
    WAITING_DRAFT  a drafter owns the next move (its draft for ``round``); meanwhile a
                   deterministic session (greedy, or raced: ``shared.race``) may be *filled*:
                   decoded target-only by steps that would otherwise idle (``fill``)
    READY          can be verified in the next step (it has a draft, or decodes target-only)
    FINISHED

A filled round's draft rests on the tokens committed before the round, so when it arrives its
leading tokens are compared with the fill: those that match are already committed (exactly what
verifying them would have committed: the argmax, or the race's winner, at each position), the
rest are verified after the fill, and a draft that left the fill verifies nothing (the drafts
after its first mismatch continue a text the target did not write).

Independently of the status, a request may still have prompt tokens to prefill: the committed
tokens not yet in its KV slot, except the last one, which every round feeds first. The core
decides token-level stops (eos, stop tokens, max_tokens, the context); stop *strings* are text
and are decided by the event loop's output side, which then finishes the request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from services.verifier.core_api import AddDraft
from services.verifier.grammar import Grammar
from shared.acceptance import matched
from shared.coupling import new_bonus_key
from shared.draft_q import CheckedQ
from shared.protocol import FinishReason, SamplingParams
from shared.race import race_key
from shared.runner import KVSlot
from shared.sampling import is_greedy, make_generator


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_DRAFT = "waiting_draft"
    READY = "ready"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_len: int
    params: SamplingParams
    speculative: bool
    max_model_len: int
    eos_ids: frozenset[int]
    committed: list[int]  # prompt + generated
    gen: torch.Generator
    status: Status = Status.WAITING
    slot: KVSlot | None = None
    round: int = 0
    draft_budget: int = 0
    draft_ids: list[int] = field(default_factory=list)
    draft_q: list[CheckedQ] | None = None
    draft_conf: list[float] | None = None  # the drafter's confidence in each draft token
    #: this round's token after a fully accepted draft is drawn by the keyed race (shared.coupling)
    guess_bonus: bool = False
    bonus_key: int = 0  # shared.coupling: keys the race (fresh entropy per request)
    #: shared.race: every token is the winner of the race keyed by this (sampled requests under race
    #: sampling); None: greedy, or sampled from ``gen``
    race_key: int | None = None
    drafter: str = ""  # node id of the drafter serving it ("" when target-only)
    reattached: bool = False  # a drafter resumed it (not the one that opened it): it must hear the committed state
    slo_tokens_per_s: float | None = None  # token-speed SLO (WISP batching); None: best effort
    draft_wait_s: float = 0.0  # how long this round waited for its draft
    #: tokens committed in this round while its draft was on its way (see the module docstring)
    fill: list[int] = field(default_factory=list)
    sent: int = 0  # draft tokens the drafter sent for this round (within its budget)
    matched: int = 0  # of those, the leading ones the fill had already committed
    #: conditional drafts for the next round (``AddDraft.after``), sent before this round's Verdict
    upcoming: list[AddDraft] = field(default_factory=list)
    last_tokens: tuple[int, ...] = ()  # what the previous round committed (a conditional draft's test)
    pause_left: int = 0  # rounds still to run target-only at the drafter's request (Draft.pause_rounds)
    grammar: Grammar | None = None  # structured output: masks p, advanced by committed tokens
    finish_reason: FinishReason | None = None
    arrived_at: float = field(default_factory=time.perf_counter)
    ready_since: float = 0.0  # perf_counter: when it became READY (queue wait starts)
    waiting_since: float = field(default_factory=time.perf_counter)  # when it began waiting for a draft

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, speculative: bool,
               max_model_len: int, eos_ids: frozenset[int], drafter: str = "",
               slo_tokens_per_s: float | None = None, generated: list[int] | None = None,
               race: bool = False) -> Request:
        """``generated``: tokens already committed after the prompt (a re-opened request);
        ``race``: a sampled request's tokens are keyed races (shared.race)."""
        return cls(request_id=request_id, prompt_len=len(prompt_ids), params=params, speculative=speculative,
                   max_model_len=max_model_len, eos_ids=frozenset() if params.ignore_eos else eos_ids,
                   committed=[*prompt_ids, *(generated or [])], gen=make_generator(params.seed, "verify"),
                   drafter=drafter, bonus_key=new_bonus_key(),
                   race_key=race_key(params.seed) if race and not is_greedy(params) else None,
                   slo_tokens_per_s=slo_tokens_per_s)

    # --- derived ---------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return is_greedy(self.params)

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_len

    @property
    def cached(self) -> int:
        return self.slot.length if self.slot is not None else 0

    @property
    def to_prefill(self) -> int:
        """Committed tokens still to cache before the round can run (all but the last)."""
        return len(self.committed) - 1 - self.cached

    def kv_tokens_needed(self, max_draft_tokens: int) -> int:
        """KV rows to reserve: everything this request can ever hold, so it never runs out."""
        most = self.prompt_len + self.params.max_tokens + max_draft_tokens
        return min(self.max_model_len, most)

    @property
    def deterministic(self) -> bool:
        """Whether each token is a function of the text before it: argmax, or a keyed race. Then
        it does not matter when, or in which round, a token is decoded."""
        return self.greedy or self.race_key is not None

    @property
    def waiting_draft(self) -> bool:
        return self.status is Status.WAITING_DRAFT

    @property
    def filled(self) -> int:
        return len(self.fill)

    @property
    def fillable(self) -> bool:
        """Whether a step may decode this session while its draft is on its way: a deterministic
        session (a token from its own stream would depend on when it was decoded), with its
        context cached."""
        return (self.status is Status.WAITING_DRAFT and self.deterministic and self.slot is not None
                and self.to_prefill == 0)

    def drafts_to_verify(self) -> list[int]:
        """This round's drafts after the fill (``take_draft`` cut them to the budget), clipped so
        the context limit is never crossed."""
        room = self.max_model_len - len(self.committed) - 1
        return self.draft_ids[: max(0, room)]

    def round_outcome(self, verified: int, accepted: int, accept_prob: float) -> tuple[int, int, float]:
        """(drafted, accepted, Σ acceptance probability) of the round as a whole (:func:`filled_outcome`)."""
        return filled_outcome(len(self.fill), self.matched, self.sent, verified, accepted, accept_prob)

    # --- transitions -----------------------------------------------------------------------

    def mark_ready(self) -> None:
        self.status = Status.READY
        self.ready_since = time.perf_counter()

    def await_draft(self) -> None:
        self.draft_ids, self.draft_q, self.draft_conf, self.guess_bonus = [], None, None, False
        self.sent, self.matched = 0, 0
        self.status = Status.WAITING_DRAFT
        self.waiting_since = time.perf_counter()

    def take_draft(self, ids: list[int], q: list[CheckedQ] | None, confidence: list[float] | None) -> None:
        """The round's draft arrived: what the fill already committed of it is matched, the rest
        is to verify (nothing when it left the fill); then the session is ready."""
        draft = ids[: max(0, self.draft_budget)]
        self.sent = len(draft)
        self.matched = matched(draft, self.fill)
        m = settled_drafts(len(draft), len(self.fill), self.matched)
        self.draft_ids = draft[m:]
        self.draft_q = q[m : len(draft)] if q is not None else None
        self.draft_conf = confidence[m : len(draft)] if confidence is not None else None
        self.mark_ready()

    def next_round(self, committed: tuple[int, ...]) -> list[AddDraft]:
        """After a verified round that committed ``committed``: wait for the drafter, or go straight
        on when target-only or when the round's budget is 0 (the drafter sends nothing for it).
        Returns the conditional drafts sent for the new round (the caller takes the one that came true)."""
        self.last_tokens = committed
        upcoming, self.upcoming = self.upcoming, []
        self.round += 1
        self.draft_ids, self.draft_q, self.draft_conf, self.guess_bonus = [], None, None, False
        self.draft_wait_s = 0.0
        self.fill, self.sent, self.matched = [], 0, 0
        self.begin_round()
        return upcoming

    def begin_round(self) -> None:
        """Wait for a draft if this round has a drafter and a budget; otherwise be ready now."""
        if self.speculative and self.draft_budget > 0:
            self.await_draft()
        else:
            self.mark_ready()

    def detach(self) -> None:
        """Continue target-only (the drafter left or went silent)."""
        self.speculative = False
        if self.status is Status.WAITING_DRAFT:
            self.mark_ready()

    def attach(self, drafter: str = "") -> bool:
        """Speculate again (a drafter resumed the session). True when the drafter must be told
        the committed state now; False when the session is not admitted yet (admission tells it)."""
        self.speculative = True
        self.reattached = True
        self.drafter = drafter or self.drafter
        self.fill = []  # the drafter hears every committed token (Attached): its draft rests on them all
        self.upcoming = []  # conditional drafts of the drafter before it: not this drafter's
        if self.status is Status.READY:  # a target-only round not run yet: it may wait for a draft instead
            self.begin_round()
            return True
        return self.status is Status.WAITING_DRAFT

    def commit(self, tokens: list[int]) -> list[int]:
        """Append a round's tokens up to the first token-level stop; returns those kept."""
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            self.committed.append(token)
            reason = self._stop_reason(token)
            if reason is not None:
                self.finish(reason)
                break
        if self.grammar is not None:
            self.grammar.advance(kept)
        return kept

    def _stop_reason(self, token: int) -> FinishReason | None:
        if token in self.eos_ids or token in self.params.stop_token_ids:
            return "stop"
        if self.generated >= self.params.max_tokens or len(self.committed) >= self.max_model_len:
            return "length"
        return None

    def finish(self, reason: FinishReason) -> None:
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.finish_reason = reason


def settled_drafts(sent: int, filled: int, matched: int) -> int:
    """How many leading drafts of a round the fill settled: the ``matched`` ones when the draft
    agreed with all ``filled`` tokens (the rest are verified after the fill), all ``sent`` when it
    left the fill or ran out inside it (nothing is verified). No fill: none."""
    return matched if matched == filled else sent


def filled_outcome(filled: int, matched: int, sent: int, verified: int, accepted: int,
                   accept_prob: float) -> tuple[int, int, float]:
    """(drafted, accepted, Σ acceptance probability) of a round as a whole, after ``verified``
    drafts were judged past a fill of ``filled`` tokens and ``accepted`` of them kept: the fill's
    ``matched`` drafts count as accepted ones (probability 1), a mismatch as one rejected draft."""
    if matched < filled:  # the draft left the fill (or ran out inside it)
        return min(sent, matched + 1), matched, float(matched)
    return matched + verified, matched + accepted, matched + accept_prob
