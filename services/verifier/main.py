"""Entry point: ``specfleet verifier [flags]`` (every flag also reads SPECFLEET_<NAME>)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import torch

from services.verifier.allocation import make_allocator
from services.verifier.backends.torch_backend import TorchBackend
from services.verifier.batching import BatchLimits, make_batcher
from services.verifier.config import VerifierConfig
from services.verifier.engine import Engine
from services.verifier.server import Hub, fleet_status_loop, start_server
from shared.config import ConfigError, describe, load_config
from shared.log import get_logger, setup_logging
from shared.models import ModelLoadError, load_model

log = get_logger("verifier")


def build(cfg: VerifierConfig) -> tuple[Hub, Engine]:
    """Load the target and wire backend, policies, engine and hub together."""
    if not cfg.model:
        raise ModelLoadError("no target model given: pass --model DIR or set SPECFLEET_MODEL")
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    loaded = load_model(cfg.model, cfg.device, cfg.dtype, cfg.max_model_len)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    backend = TorchBackend(loaded, pad_id=pad)
    hub = Hub(loaded.name, loaded.fingerprint, loaded.max_model_len, cfg.max_draft_tokens, cfg.auth_token)
    engine = Engine(
        backend, loaded.tokenizer, loaded.eos_ids, hub,
        allocator=make_allocator(cfg.allocation, cfg.draft_len), batcher=make_batcher(cfg.batching),
        limits=BatchLimits(cfg.max_batch_sessions, cfg.max_batch_tokens), max_sessions=cfg.max_sessions,
        max_draft_tokens=cfg.max_draft_tokens, draft_timeout_s=cfg.draft_timeout_s,
    )
    hub.engine = engine
    return hub, engine


async def serve(cfg: VerifierConfig, ready: asyncio.Event | None = None) -> None:
    hub, engine = await asyncio.to_thread(build, cfg)
    server = await start_server(hub, cfg.host, cfg.port)
    port = server.sockets[0].getsockname()[1] if server.sockets else cfg.port
    log.info("verifier listening", host=cfg.host, port=port, model=hub.welcome.target_model,
             max_model_len=hub.welcome.max_model_len)
    tasks = [asyncio.create_task(engine.run()), asyncio.create_task(fleet_status_loop(hub))]
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait([asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            if t.done() and t.exception():
                raise t.exception()  # type: ignore[misc]
    finally:
        engine.stop()
        for t in tasks:
            t.cancel()
        server.close()
        await server.wait_closed()
        log.info("verifier stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(VerifierConfig, argv if argv is not None else sys.argv[1:], prog="specfleet verifier")
    except ConfigError as exc:
        print(f"specfleet verifier: {exc}", file=sys.stderr)
        return 2
    setup_logging("verifier", cfg.log_level)
    log.info("starting", config=describe(cfg))
    try:
        asyncio.run(serve(cfg))
    except ModelLoadError as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
