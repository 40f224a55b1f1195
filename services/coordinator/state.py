"""Everything one coordinator app shares between its handlers, in one object on ``app.state``."""

from __future__ import annotations

import base64
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from services.coordinator.config import CoordinatorConfig
from services.coordinator.fleet import FleetMonitor
from services.coordinator.generation import Generator, Submission
from services.coordinator.logprobs import LogprobsFormatter
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.model_info import ModelInfo
from services.coordinator.openai_api import GenerationRequest, Kind, build_request
from services.coordinator.ratelimit import RateLimiter
from services.coordinator.resumption import Resumes
from services.coordinator.verifier_link import FrontendLink
from services.coordinator.verifier_pool import VerifierPool
from shared.protocol import SamplingParams
from shared.queue import RequestQueue


@dataclass
class CoordinatorState:
    cfg: CoordinatorConfig
    node_id: str
    model: ModelInfo
    queue: RequestQueue
    link: FrontendLink | VerifierPool
    generator: Generator
    resumes: Resumes  # resumable streams: their records, and taking one over
    metrics: CoordinatorMetrics
    limiter: RateLimiter = field(default_factory=RateLimiter)
    fleet: FleetMonitor | None = None  # the dashboard's readings (``fleet.py``); set by create_app

    def logprobs_formatter(self, kind: Kind, params: SamplingParams) -> LogprobsFormatter | None:
        """Formats the logprobs of a request that asked for them (None: it did not)."""
        return LogprobsFormatter(kind, self.model.token_strings) if params.logprobs is not None else None

    def max_model_len(self) -> int:
        """The tighter of the target's own context and the verifier's configured limit."""
        verifier = self.link.max_model_len
        return min(self.model.max_model_len, verifier) if verifier > 0 else self.model.max_model_len

    async def start(
        self, kind: Kind, load_body: Callable[[], Awaitable[dict[str, Any]]], client: str = "", request_id: str = "",
        send: bool = True,
    ) -> tuple[GenerationRequest, Submission]:
        """Admit one request (429 over ``client``'s rate limit or at the in-flight cap, before its
        body is even read), then load, validate, charge ``client``'s token quota (every choice's
        ``max_tokens``) and submit choice 0 (``send=False``: subscribed only, :meth:`send` sends
        it). The Submission owns the admission slot; on any failure here the slot is already released."""
        self.limiter.admit(client)
        slot = self.generator.admission.admit()
        try:
            req = await build_request(kind, await load_body(), self.model, self.max_model_len())
            self.limiter.charge(client, req.params.max_tokens * req.n)
        except BaseException:
            slot.release()
            raise
        try:
            return req, await self.generator.submit(req, slot, request_id, send)
        except BaseException:  # refused before any work (verifier down, queue full): no quota spent
            self.limiter.refund(client, req.params.max_tokens * req.n)
            raise

    async def more_choices(self, req: GenerationRequest, send: bool = True) -> list[Submission]:
        """Submit choices 1..n-1 of ``req`` (choice 0 is :meth:`start`'s), each an independent
        session with its own admission slot. On failure, those already submitted are closed."""
        subs: list[Submission] = []
        try:
            for i in range(1, req.n):
                subs.append(await self.generator.submit(req.choice(i), self.generator.admission.admit(), send=send))
        except BaseException:
            for s in subs:
                s.close()
            raise
        return subs

    async def send(self, client: str, req: GenerationRequest, subs: list[Submission]) -> None:
        """Send the choices :meth:`start` and :meth:`more_choices` held (``send=False``), once the
        stream is recorded: a coordinator killed in between then leaves no request running that its
        client cannot resume. On a failure every choice is cancelled (its client gets the error, so none
        is kept for a resume), and the quota refunded if none went out."""
        for i, sub in enumerate(subs):
            try:
                await self.generator.send(req.choice(i), sub)
            except BaseException:
                for other in subs:
                    other.resumable = False
                    other.close()
                if i == 0:
                    self.limiter.refund(client, req.params.max_tokens * req.n)
                raise

    def authorized(self, authorization: str | None, browser: bool = False) -> bool:
        """True when no API key is configured, or the header is exactly 'Bearer <one of the keys>'.
        With ``browser`` (the dashboard and ``/v1/fleet`` only, which change nothing), also HTTP Basic
        with one of the keys as the password (any user name: what a browser sends once its login
        prompt has been answered). The API takes no Basic: a browser's cached login must not let
        another site's page send requests in the operator's name."""
        keys = [k.strip() for k in (self.cfg.clients.api_key, *self.cfg.clients.api_keys.split(",")) if k.strip()]
        if not keys:
            return True
        given = (authorization or "").strip()
        scheme, _, value = given.partition(" ")
        if browser and scheme.lower() == "basic":
            given = f"Bearer {_basic_password(value.strip())}"
        return any(hmac.compare_digest(given.encode(), f"Bearer {k}".encode()) for k in keys)  # no early exit

    def missing(self) -> list[str]:
        """Why the fleet cannot serve as configured (empty: ready): what ``/ready`` answers."""
        link, missing = self.link, []
        if self.generator.admission.draining:
            missing.append("the coordinator is shutting down (draining in-flight requests)")
        if not link.connected:
            missing.append(f"verifier link is down: {link.last_error}")
        elif not link.drafters and self.generator.speculation != "off":
            missing.append("no drafter is connected to the verifier")
        return missing


def _basic_password(credentials: str) -> str:
    """The password of an HTTP Basic ``user:password`` in base64 ('' when it is malformed)."""
    try:
        return base64.b64decode(credentials, validate=True).decode().partition(":")[2]
    except (ValueError, UnicodeDecodeError):
        return ""


def state_of(request: Request) -> CoordinatorState:
    state: CoordinatorState = request.app.state.coordinator
    return state
