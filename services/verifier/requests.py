"""Per-session state inside the engine core: one ``Request`` per session, with a status enum.

    WAITING        admitted by the event loop, waiting for KV memory
    WAITING_DRAFT  a drafter owns the next move (its draft for the round); meanwhile a
                   deterministic session (greedy, or raced: ``shared.race``) may be *filled*:
                   decoded target-only by steps that would otherwise idle (``fill``)
    READY          can be verified in the next step (it has a draft, or decodes target-only)
    FINISHED

The request holds what lasts (its tokens, how they are drawn, its stop rules, its drafter); its
current round is a :class:`~services.verifier.round.state.Round` (the round package owns a
round's rules). Independently of the status, a request may still have prompt tokens to prefill:
the committed tokens not yet in its KV slot, except the last one, which every round feeds first.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from services.verifier.grammar import Grammar
from services.verifier.round.draft import SettledDraft
from services.verifier.round.state import Round
from services.verifier.round.stops import Stops
from shared.coupling import new_bonus_key
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
class Sampler:
    """How a request's tokens are drawn (what ``judge`` reads besides its drafts)."""

    params: SamplingParams
    gen: torch.Generator  # its own stream (a seed's, or fresh)
    bonus_key: int = field(default_factory=new_bonus_key)  # shared.coupling: keys the bonus token's race
    #: shared.race: every token is the winner of the race keyed by this (sampled requests under race
    #: sampling); None: greedy, or sampled from ``gen``
    race_key: int | None = None
    grammar: Grammar | None = None  # structured output: masks p, advanced by committed tokens

    @classmethod
    def of(cls, params: SamplingParams, race: bool, grammar: Grammar | None = None) -> Sampler:
        """``race``: a sampled request's tokens are keyed races (shared.race)."""
        return cls(params, make_generator(params.seed, "verify"),
                   race_key=race_key(params.seed) if race and not is_greedy(params) else None, grammar=grammar)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.params)


class Request:
    def __init__(self, request_id: str, committed: list[int], sampler: Sampler, stops: Stops, *,
                 drafter: str = "", speculative: bool = True, slo_tokens_per_s: float | None = None) -> None:
        """``committed``: the prompt, then any tokens already generated (a re-opened request)."""
        self.request_id, self.committed, self.sampler, self.stops = request_id, committed, sampler, stops
        self.drafter = drafter  # node id of the drafter serving it ("" when target-only)
        self.speculative = speculative  # a drafter drafts its rounds
        self.reattached = False  # a drafter resumed it (not the one that opened it): it must hear the committed state
        self.slo_tokens_per_s = slo_tokens_per_s  # token-speed SLO (WISP batching); None: best effort
        self.status = Status.WAITING
        self.slot: KVSlot | None = None
        self.round = Round()
        self.finish_reason: FinishReason | None = None
        self.arrived_at = time.perf_counter()
        self.ready_since = 0.0  # perf_counter: when it became READY (queue wait starts)

    # --- derived ---------------------------------------------------------------------------

    @property
    def params(self) -> SamplingParams:
        return self.sampler.params

    @property
    def greedy(self) -> bool:
        return self.sampler.greedy

    @property
    def prompt_len(self) -> int:
        return self.stops.prompt_len

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

    @property
    def deterministic(self) -> bool:
        """Whether each token is a function of the text before it: argmax, or a keyed race. Then
        it does not matter when, or in which round, a token is decoded."""
        return self.sampler.greedy or self.sampler.race_key is not None

    # --- what the fill reads (``fill.Waiting``) ----------------------------------------------

    @property
    def waiting_draft(self) -> bool:
        return self.status is Status.WAITING_DRAFT

    @property
    def fillable(self) -> bool:
        """Whether a step may decode this session while its draft is on its way: a deterministic
        session (a token from its own stream would depend on when it was decoded), with its
        context cached."""
        return (self.status is Status.WAITING_DRAFT and self.deterministic and self.slot is not None
                and self.to_prefill == 0)

    @property
    def filled(self) -> int:
        return len(self.round.fill)

    @property
    def waiting_since(self) -> float:
        return self.round.waiting_since

    @property
    def first_round(self) -> bool:
        return self.round.number == 0

    @property
    def draft_budget(self) -> int:
        return self.round.budget

    def drafts_to_verify(self) -> list[int]:
        """This round's drafts after the fill, clipped so the context limit is never crossed."""
        return self.round.draft.ids[: self.stops.draft_room(len(self.committed))]

    # --- transitions -----------------------------------------------------------------------

    def mark_ready(self) -> None:
        self.status = Status.READY
        self.ready_since = time.perf_counter()

    def begin_round(self) -> None:
        """Wait for a draft if this round has a drafter and a budget; otherwise be ready now."""
        if self.speculative and self.round.budget > 0:
            self.round.draft = SettledDraft()
            self.status = Status.WAITING_DRAFT
            self.round.waiting_since = time.perf_counter()
        else:
            self.mark_ready()

    def next_round(self, committed: tuple[int, ...]) -> None:
        """After a verified round that committed ``committed``: wait for the drafter, or go straight
        on when target-only or when the round's budget is 0 (the drafter sends nothing for it)."""
        self.round.advance(committed)
        self.begin_round()

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
        self.round.fill = []  # the drafter hears every committed token (Attached): its draft rests on them all
        self.round.upcoming.clear()  # conditional drafts of the drafter before it: not this drafter's
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
            reason = self.stops.after(token, len(self.committed))
            if reason is not None:
                self.finish(reason)
                break
        if self.sampler.grammar is not None:
            self.sampler.grammar.advance(kept)
        return kept

    def finish(self, reason: FinishReason) -> None:
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.finish_reason = reason
