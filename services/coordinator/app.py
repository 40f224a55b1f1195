"""Composition of the coordinator app: model info, queue, verifier link, metrics and routes.

Nothing here handles a request. ``create_app`` wires the parts, and the lifespan starts the
verifier link with the server and closes what the app opened when it stops. Tests pass their own
queue or link to run the same app against in-process or fake peers.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.coordinator.admission import InFlightLimit
from services.coordinator.config import CoordinatorConfig, check_config
from services.coordinator.errors import install_error_handlers
from services.coordinator.fleet import FleetMonitor
from services.coordinator.fleet_routes import router as fleet_router
from services.coordinator.generation import Generator
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.model_info import ModelInfo
from services.coordinator.queue_fallback import QueueFallback
from services.coordinator.queue_link import make_queue_router
from services.coordinator.ratelimit import RateLimiter
from services.coordinator.resumption import Resumes
from services.coordinator.routes import router
from services.coordinator.state import CoordinatorState
from services.coordinator.stream_store import StoreError, open_store
from services.coordinator.verifier_link import FrontendLink
from services.coordinator.verifier_pool import VerifierPool
from shared.config import ConfigError, url_list
from shared.credentials import Credentials, CredentialsError
from shared.queue import RequestQueue, open_queue
from shared.queue_memory import MemoryQueue
from shared.tls import TlsConfigError, client_context


def default_node_id() -> str:
    """Unique per process start: a restarted container keeps its hostname and often its pid (1),
    and the verifier must tell the new process from the dead one, whose queued requests it drops."""
    return f"coordinator-{socket.gethostname()[:80]}-{os.getpid()}-{secrets.token_hex(3)}"


def create_app(
    cfg: CoordinatorConfig,
    queue: RequestQueue | None = None,
    link: FrontendLink | VerifierPool | None = None,
    model: ModelInfo | None = None,
) -> FastAPI:
    """The coordinator as an ASGI app. Without a given queue: Redis Streams when ``redis_url``
    is set, else an in-process MemoryQueue (at most ``max_queue`` waiting) served to drafters on
    ``/internal/queue``."""
    check_config(cfg)
    node_id = cfg.server.node_id or default_node_id()
    model = model or ModelInfo.load(cfg.target.model, cfg.target.served_model_name)
    owns_queue = queue is None
    if queue is None:
        queue = (open_queue(cfg.queue.redis_url, stream=cfg.queue.queue_stream, group=cfg.queue.queue_group)
                 if cfg.queue.redis_url else MemoryQueue(max_depth=cfg.admission.max_queue))
    urls = url_list(cfg.target.verifier_url, "--verifier-url")
    try:
        verifier_tls = client_context(urls[0], cfg.security.tls_ca)
        credentials = Credentials(cfg.security.auth_token, cfg.security.credentials_file)
    except (TlsConfigError, CredentialsError) as exc:
        raise ConfigError(str(exc)) from None
    if link is None and len(urls) > 1:  # several verifier replicas, with session affinity and failover
        link = VerifierPool(urls, node_id, cfg.security.auth_token, model.fingerprint, tls=verifier_tls)
    link = link or FrontendLink(urls[0], node_id, cfg.security.auth_token, model.fingerprint, tls=verifier_tls)
    if isinstance(queue, MemoryQueue):  # a request's end frees its drafter's room at once (shared/queue_memory.py)
        link.routing.on_finished = queue.note_finished
    metrics = CoordinatorMetrics()
    metrics.in_flight_limit.set(cfg.admission.max_in_flight)
    admission = InFlightLimit(cfg.admission.max_in_flight, cfg.admission.retry_after_s, metrics.in_flight)
    generator = Generator(queue, link, node_id, cfg.server.request_timeout_s, metrics, cfg.target.speculation,
                          admission)
    try:
        store = open_store(cfg.queue.redis_url, cfg.queue.stream_store)
    except StoreError as exc:
        raise ConfigError(f"--stream-store: {exc}") from None
    state = CoordinatorState(
        cfg=cfg, node_id=node_id, model=model, queue=queue, link=link, generator=generator,
        resumes=Resumes(store, generator, link, node_id, cfg.server.request_timeout_s, cfg.security.auth_token),
        metrics=metrics,
        limiter=RateLimiter(cfg.clients.rate_limit_rps, cfg.clients.rate_limit_burst, cfg.clients.token_quota,
                            cfg.clients.quota_window_s),
    )

    monitor = state.fleet = FleetMonitor(state, urls, cfg.security.auth_token, verifier_tls)
    q = cfg.queue
    fallback = (QueueFallback(link, q.queue_fallback_s, q.queue_wait_s, counter=metrics.queue_fallback,
                              queue=queue if isinstance(queue, MemoryQueue) else None)
                if cfg.target.speculation == "auto" and (q.queue_fallback_s or q.queue_wait_s) else None)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await link.start()
        tasks = [asyncio.create_task(fallback.run(), name="queue-fallback")] if fallback is not None else []
        tasks.append(asyncio.create_task(monitor.run(), name="fleet-monitor"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await link.stop()
            await store.close()
            if owns_queue:
                await queue.close()

    app = FastAPI(title="specfleet coordinator", lifespan=lifespan)
    app.state.coordinator = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(fleet_router)
    if not cfg.queue.redis_url:
        app.include_router(make_queue_router(queue, credentials, node_id=node_id))
    return app
