"""Per-session state on the verifier: committed tokens, stop decisions, statistics.

One ``Session`` per request, with an explicit status. The verifier owns the committed text:
it alone decides when a session stops (eos, stop token, stop string, max_tokens, context).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.verifier.detok import IncrementalText
from shared.protocol import Draft, FinishReason, SamplingParams
from shared.sampling import make_generator


class Status(enum.Enum):
    WAITING_DRAFT = "waiting_draft"  # a drafter owns the next move
    READY = "ready"  # can be verified in the next batch
    FINISHED = "finished"


@dataclass
class Session:
    request_id: str
    origin: str  # the frontend that receives TokenEvents
    prompt_ids: list[int]
    params: SamplingParams
    drafter: str | None  # connection id of the drafter, None when autonomous (target-only)
    max_model_len: int
    eos_ids: set[int]
    text: IncrementalText
    status: Status = Status.WAITING_DRAFT
    owner: str | None = None  # the drafter connection that opened it (gets the final Verdict)
    round: int = 0
    draft_budget: int = 0
    draft: Draft | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    drafted: int = 0
    accepted: int = 0
    ready_since: float = 0.0
    waiting_since: float = field(default_factory=time.monotonic)
    created_at: float = field(default_factory=time.monotonic)
    gen: torch.Generator = field(default_factory=lambda: make_generator(None))

    @classmethod
    def create(
        cls, request_id: str, origin: str, prompt_ids: list[int], params: SamplingParams,
        drafter: str | None, max_model_len: int, eos_ids: set[int], tokenizer: Any,
    ) -> Session:
        s = cls(
            request_id=request_id, origin=origin, prompt_ids=list(prompt_ids), params=params,
            drafter=drafter, max_model_len=max_model_len, eos_ids=set() if params.ignore_eos else eos_ids,
            text=IncrementalText(tokenizer, list(params.stop)), gen=make_generator(params.seed),
        )
        if drafter is None:
            s.mark_ready()
        return s

    @property
    def autonomous(self) -> bool:
        return self.drafter is None

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt_ids[-1]

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def mark_ready(self, draft: Draft | None = None) -> None:
        self.draft = draft
        self.status = Status.READY
        self.ready_since = time.monotonic()

    def wait_for_draft(self) -> None:
        self.draft = None
        self.status = Status.WAITING_DRAFT
        self.waiting_since = time.monotonic()

    def detach(self) -> None:
        """Continue without a drafter (it left, closed the session, or went silent)."""
        self.drafter = None
        self.owner = None
        if self.status is Status.WAITING_DRAFT:
            self.mark_ready()

    def draft_tokens(self) -> list[int]:
        """The drafts to verify this round, clipped so the context limit is never crossed."""
        if self.draft is None:
            return []
        room = self.max_model_len - self.context_len - 1
        return list(self.draft.token_ids[: max(0, min(self.draft_budget, room))])

    def commit(self, new_tokens: list[int]) -> list[int]:
        """Append this round's tokens, stopping at the first stop condition.

        Returns the tokens actually committed (a suffix after a stop is dropped).
        """
        kept: list[int] = []
        for token in new_tokens:
            kept.append(token)
            self.generated.append(token)
            reason = self._stop_reason(token)
            if reason is not None:
                self.finish(reason)
                break
        return kept

    def _stop_reason(self, token: int) -> FinishReason | None:
        if token in self.eos_ids or token in self.params.stop_token_ids:
            return "stop"
        if self.text.push(token):
            return "stop"
        if len(self.generated) >= self.params.max_tokens or self.context_len >= self.max_model_len:
            return "length"
        return None

    def finish(self, reason: FinishReason) -> None:
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.finish_reason = reason
