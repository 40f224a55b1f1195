"""Run the coordinator: ``python -m services.coordinator.main`` or ``specfleet coordinator``."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import uvicorn

from services.coordinator.app import create_app
from services.coordinator.config import CoordinatorConfig
from services.coordinator.drain import DrainingServer, drain_on_signal
from shared.config import ConfigError, describe, load_config
from shared.log import get_logger, setup_logging
from shared.models import ModelLoadError
from shared.protocol import MAX_FRAME_BYTES
from shared.queue import QueueError
from shared.tls import TlsConfigError, server_context

log = get_logger("coordinator.main")


async def serve(cfg: CoordinatorConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled or signalled (a signal drains first: drain.py); ``ready`` is set once
    the port accepts connections."""
    app = create_app(cfg)
    try:
        # refuse unusable files before binding, naming the flag
        server_context(cfg.security.tls_cert, cfg.security.tls_key)
    except TlsConfigError as exc:
        raise ConfigError(str(exc)) from None
    tls = {"ssl_certfile": cfg.security.tls_cert, "ssl_keyfile": cfg.security.tls_key} if cfg.security.tls_cert else {}
    config = uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_config=None, access_log=False,
        ws_max_size=MAX_FRAME_BYTES, lifespan="on", timeout_graceful_shutdown=5,
        ws_per_message_deflate=False,  # token frames are small: deflating each costs CPU for nothing
        **tls,  # type: ignore[arg-type]
    )
    server = DrainingServer(config)
    task = asyncio.create_task(server.serve(), name="uvicorn")
    drain = asyncio.create_task(drain_on_signal(server, app.state.coordinator.generator.admission,
                                                cfg.server.drain_timeout_s), name="drain")
    try:
        while not server.started:
            if task.done():  # failed before binding (port in use, lifespan error): surface it
                await task
                raise OSError(f"the coordinator could not listen on {cfg.server.host}:{cfg.server.port}")
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else cfg.server.port
        log.info("coordinator listening", host=cfg.server.host, port=port, tls=bool(cfg.security.tls_cert))
        if ready is not None:
            ready.set()
        await asyncio.shield(task)  # a cancelled serve() shuts uvicorn down gracefully, below
    finally:
        drain.cancel()
        if not task.done():
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await task


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(CoordinatorConfig, argv, prog="specfleet coordinator")
    setup_logging("coordinator", cfg.server.log_level)
    settings = describe(cfg)
    settings["api_key"] = "***" if cfg.clients.api_key else ""
    log.info("starting", **settings)
    try:
        asyncio.run(serve(cfg))
    except (ConfigError, ModelLoadError, QueueError, OSError) as exc:
        log.error("coordinator failed to start", error=str(exc))
        print(f"specfleet coordinator: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
