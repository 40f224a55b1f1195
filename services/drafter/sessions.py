"""Per-session drafter state: the committed sequence, the round counter, statistics.

A session is one queued request from ``OpenSession`` to its final Verdict. The drafter keeps
the committed sequence itself (prompt + every committed token) because it needs it to clamp
draft lengths and to report; the proposer keeps its own copy alongside its cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.drafter.control.base import DraftController
from services.drafter.lookahead import Lookahead
from services.drafter.proposers.base import JobSession
from shared.protocol import SamplingParams, Verdict
from shared.queue import Delivery
from shared.sampling import is_greedy, make_generator


@dataclass
class SessionStats:
    rounds: int = 0
    drafted: int = 0  # draft tokens sent
    accepted: int = 0  # draft tokens the target accepted
    draft_s: float = 0.0  # wall time spent drafting (queueing for the worker included)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class DraftSession:
    delivery: Delivery
    controller: DraftController
    committed: list[int] = field(default_factory=list)
    rng: torch.Generator = field(default_factory=lambda: make_generator(None, "draft"))
    # the session's state as its rounds go by (SessionOpened and Verdicts set it)
    round: int = field(init=False, default=0)
    budget: int = field(init=False, default=0)
    finish_reason: str | None = field(init=False, default=None)
    #: set when the proposer failed; the session then sends empty drafts
    drafting_disabled: str = field(init=False, default="")
    #: duplicate deliveries to ack at the end
    extra_deliveries: list[str] = field(init=False, default_factory=list)
    stats: SessionStats = field(init=False, default_factory=SessionStats)
    lookahead: Lookahead = field(init=False, default_factory=Lookahead)
    #: the verifier's coupled-bonus key (SessionOpened; shared.coupling)
    bonus_key: int | None = field(init=False, default=None)
    #: the request's race key (SessionOpened; shared.race): its tokens are keyed races
    race_key: int | None = field(init=False, default=None)
    started_at: float = field(init=False, default_factory=time.monotonic)

    @classmethod
    def from_delivery(cls, delivery: Delivery, controller: DraftController) -> DraftSession:
        req = delivery.request
        return cls(
            delivery=delivery,
            controller=controller,
            committed=list(req.prompt_ids),
            rng=make_generator(req.params.seed, "draft"),
        )

    def drafting(self) -> JobSession:
        """What each of its draft jobs carries about it."""
        return JobSession(self.request_id, self.params, self.rng, self.prompt_len, self.race_key)

    @property
    def request_id(self) -> str:
        return self.delivery.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.delivery.request.params

    @property
    def prompt_len(self) -> int:
        return len(self.delivery.request.prompt_ids)

    @property
    def deterministic(self) -> bool:
        """Whether the verifier's every token is a function of the text before it (argmax, or a keyed
        race), so a draft's runner-up guesses its correction and a lookahead draws no randomness."""
        return is_greedy(self.params) or self.race_key is not None

    @property
    def generated(self) -> int:
        return len(self.committed) - self.prompt_len

    def useful_draft_len(self, budget: int) -> int:
        """Cap the verifier's budget at what can still be used.

        A round commits the accepted drafts plus one token of the verifier's own, so with
        ``remaining`` tokens left to generate, more than ``remaining - 1`` drafts are waste.
        """
        remaining = self.params.max_tokens - self.generated
        return max(0, min(budget, remaining - 1))

    def apply_verdict(self, verdict: Verdict, drafted: int) -> list[int]:
        """Record one round's outcome; returns the newly committed tokens."""
        new = list(verdict.token_ids)
        self.committed.extend(new)
        self.stats.rounds += 1
        self.stats.drafted += drafted
        self.stats.accepted += min(verdict.accepted, drafted)
        self.budget = verdict.draft_budget
        self.round += 1
        if verdict.finished:
            self.finish_reason = verdict.finish_reason or "stop"
        return new

    def summary(self) -> dict[str, Any]:
        """The per-session line logged at finish."""
        return {
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "rounds": self.stats.rounds,
            "drafted": self.stats.drafted,
            "accepted": self.stats.accepted,
            "acceptance_rate": round(self.stats.acceptance_rate, 4),
            "generated": self.generated,
            "draft_s": round(self.stats.draft_s, 4),
            "wall_s": round(time.monotonic() - self.started_at, 4),
        }
