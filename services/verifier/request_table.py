"""The torch core's requests: added, admitted when their KV memory fits, attached to a drafter or
detached from one, retired. Runs on the core's thread, inside its loop's first two steps."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from services.verifier.batching.base import slo_met
from services.verifier.core_api import AddRequest, Admitted, Attach, Attached, Detached, KVStats, RequestRefused, Result
from services.verifier.metrics import VerifierMetrics
from services.verifier.requests import Request, Sampler, Status
from services.verifier.round import DraftBudgets, Stops
from shared.log import get_logger
from shared.runner.kv import KVArena

log = get_logger("verifier.core")
EXPIRY_CHECK_S = 0.1  # how often the loop looks for drafters that went silent


@dataclass(frozen=True)
class CoreLimits:
    max_draft_tokens: int
    draft_timeout_s: float
    max_waiting: int  # requests held for KV memory before new ones are refused as busy
    max_commands: int = 65536
    default_slo_tokens_per_s: float | None = None  # SLO class of requests that name none
    recompute_context: bool = False  # SLED-like baseline: no KV reuse across rounds (benchmarks only)
    share_prefixes: bool = True  # copy prompt prefixes other live requests computed (prefix.py)
    race: bool = True  # sample sampled requests by keyed races (shared.race), else from their own stream


@dataclass(frozen=True)
class TargetLimits:
    """What the target model bounds: its end-of-sequence ids and its context."""

    eos_ids: frozenset[int]
    max_model_len: int


class RequestTable:
    def __init__(self, kv: KVArena, budgets: DraftBudgets, limits: CoreLimits, target: TargetLimits,
                 results: list[Result], metrics: VerifierMetrics) -> None:
        self.kv, self.budgets, self.limits, self.target = kv, budgets, limits, target
        self.results, self.metrics = results, metrics
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self._expiry_checked = 0.0

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> KVStats:
        kv = self.kv
        return KVStats(budget_bytes=kv.budget_bytes, reserved_bytes=kv.reserved_tokens * kv.shape.bytes_per_token,
                       cached_tokens=kv.cached_tokens, sessions=kv.sessions, waiting=len(self.waiting))

    # --- commands ------------------------------------------------------------------------

    def add(self, cmd: AddRequest) -> None:
        sampler = Sampler.of(cmd.params, self.limits.race, cmd.grammar)
        if cmd.grammar is not None and cmd.generated:  # a re-opened request: its grammar resumes where its text is
            cmd.grammar.advance(cmd.generated)
        req = Request(cmd.request_id, [*cmd.prompt_ids, *cmd.generated], sampler,
                      Stops.of(cmd.params, len(cmd.prompt_ids), self.target.eos_ids, self.target.max_model_len),
                      drafter=cmd.drafter, speculative=cmd.speculative,
                      slo_tokens_per_s=cmd.slo_tokens_per_s or self.limits.default_slo_tokens_per_s)
        req.arrived_at -= cmd.carried.waited_s
        need = req.stops.kv_tokens_needed(self.limits.max_draft_tokens)
        must_wait = bool(self.waiting) or not self.kv.fits(need)
        if need > self.kv.tokens:
            self.results.append(RequestRefused(cmd.request_id, "invalid", (
                f"the request needs {need} tokens of KV cache but the verifier holds {self.kv.tokens} in all; "
                "ask for fewer max_tokens or raise the verifier's --kv-cache-gb")))
        elif must_wait and len(self.waiting) >= self.limits.max_waiting:
            self.results.append(RequestRefused(cmd.request_id, "busy", (
                f"the verifier's KV cache is full and {len(self.waiting)} requests already wait for it; retry later")))
        else:
            self.requests[req.request_id] = req
            self.waiting.append(req)
            self.admit()

    def detach(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.detach()
            self.budgets.detach(req.request_id)

    def attach(self, cmd: Attach) -> None:
        req = self.requests.get(cmd.request_id)
        if req is None or req.status is Status.FINISHED:
            return  # finishing: its final Verdict reaches the new drafter
        self.budgets.attach(req.request_id, cmd.drafter)
        if req.slot is not None and req.status is Status.READY:  # its next round may be drafted again
            req.round.budget = self.budgets.initial(req.request_id)
        if not req.attach(cmd.drafter):
            return  # waiting for KV memory: Admitted opens it
        self.results.append(Attached(req.request_id, req.committed[req.prompt_len:], req.round.number,
                                     req.round.budget, req.sampler.bonus_key, req.sampler.race_key))

    def cancel(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.finish("cancelled")
            self.retire(req)

    def expire_silent_drafters(self) -> None:
        now = time.perf_counter()
        if now - self._expiry_checked < EXPIRY_CHECK_S:
            return
        self._expiry_checked = now
        for req in self.requests.values():
            if req.status is Status.WAITING_DRAFT and now - req.waiting_since > self.limits.draft_timeout_s:
                log.warning("no draft in time; session continues target-only", request_id=req.request_id,
                            waited_s=round(now - req.waiting_since, 1))
                self.detach(req.request_id)
                self.results.append(Detached(req.request_id))

    # --- admission -----------------------------------------------------------------------

    def can_admit(self) -> bool:
        return bool(self.waiting) and self.kv.fits(self.waiting[0].stops.kv_tokens_needed(self.limits.max_draft_tokens))

    def admit(self) -> None:
        if not self.can_admit():
            return
        while self.can_admit():
            req = self.waiting.popleft()
            req.slot = self.kv.allocate(req.stops.kv_tokens_needed(self.limits.max_draft_tokens))
            budget = req.round.budget = self.budgets.open(req.request_id, req.drafter) if req.speculative else 0
            req.begin_round()
            keys = (req.sampler.bonus_key, req.sampler.race_key)
            if req.reattached and req.speculative:  # a drafter resumed it while it waited: tell it where it is
                self.results.append(Attached(req.request_id, req.committed[req.prompt_len:], req.round.number,
                                             budget, *keys))
            else:
                self.results.append(Admitted(req.request_id, budget, *keys))
        self.metrics.set_kv(self.stats())

    def retire(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if req.slot is not None:
            self.kv.free(req.slot)
            req.slot = None
        elif req in self.waiting:
            self.waiting.remove(req)
        self.budgets.forget(req.request_id)
        if req.finish_reason in ("stop", "length"):
            self.metrics.count_slo(req.slo_tokens_per_s,
                                   slo_met(req.arrived_at, req.generated, req.slo_tokens_per_s, time.perf_counter()))
        self.metrics.set_kv(self.stats())
