"""Entry point: ``specfleet verifier [flags]`` (every flag also reads SPECFLEET_<NAME>)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import torch

from services.verifier.allocation import AllocationSettings, Allocator, GoodputTracker, make_allocator
from services.verifier.allocation.pays import PaysGuard
from services.verifier.batching import BatchLimits, make_batcher
from services.verifier.batching.estimator import StepTimeEstimator
from services.verifier.config import VerifierConfig, validate
from services.verifier.core import CoreLimits, TorchCore
from services.verifier.core_api import CoreDied, Result, VerifierCore
from services.verifier.fill import make_fill
from services.verifier.fleet_view import EngineInfo
from services.verifier.intake import Intake
from services.verifier.metrics import VerifierMetrics
from services.verifier.output import Output
from services.verifier.profile import calibrate
from services.verifier.scheduler import Scheduler
from services.verifier.server import Hub, fleet_status_loop, make_welcome, revocation_loop, start_server
from services.verifier.sessions import Routes
from services.verifier.trim import make_trim
from shared.config import ConfigError, describe, load_config
from shared.credentials import Credentials, CredentialsError
from shared.log import get_logger, setup_logging
from shared.models import LoadedModel, ModelLoadError, cpu_has_native_bf16, load_model, load_target_info
from shared.runner import KVError, ModelRunner
from shared.runner.runner import NotInvariantError
from shared.tls import TlsConfigError, server_context

log = get_logger("verifier")
#: the automatic KV budget on a CPU: this share of RAM, at most AUTO_KV_CPU_MAX bytes
AUTO_KV_CPU_SHARE = 0.2
AUTO_KV_CPU_MAX = 2 * 2**30
#: ... and on a GPU, this share of the memory still free after the model loaded
AUTO_KV_GPU_SHARE = 0.8


def kv_budget_bytes(cfg: VerifierConfig) -> int:
    if cfg.capacity.kv_cache_gb > 0:
        return int(cfg.capacity.kv_cache_gb * 2**30)
    if cfg.target.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(cfg.target.device))
        return int(free * AUTO_KV_GPU_SHARE)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(AUTO_KV_CPU_MAX, int(ram * AUTO_KV_CPU_SHARE))


def core_threaded(mode: str) -> bool:
    """thread / inline / auto: a thread of its own unless the process may use a single CPU
    (``config.validate`` has refused any other word)."""
    if mode == "auto":
        return len(os.sched_getaffinity(0)) > 1
    return mode == "thread"


def make_estimator(cfg: VerifierConfig) -> StepTimeEstimator:
    """The step-time estimator: profiled coefficients when given, refined online either way."""
    if not cfg.engine.estimator_file:
        return StepTimeEstimator()
    try:
        return StepTimeEstimator.load(cfg.engine.estimator_file)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read --estimator-file {cfg.engine.estimator_file}: {exc}; "
                             "write one with `make profile-verifier`") from None




def calibrate_estimator(runner: ModelRunner, estimator: StepTimeEstimator, max_len: int) -> None:
    """Fit the step-time estimator on forwards timed on ``runner`` (:func:`services.verifier.profile.calibrate`)."""
    try:
        seconds = calibrate(runner, estimator, max_len)
    except ValueError as exc:  # a tiny arena or context: the generic guess, refined online, it is
        log.warning("step-time estimator not calibrated; starting from a generic CPU guess", reason=str(exc))
        return
    a, b, c, d = estimator.coef
    log.info("step-time estimator calibrated", seconds=round(seconds, 2), per_token_us=round(a * 1e6, 2),
             per_query_key_ns=round(b * 1e9, 3), per_cached_row_ns=round(c * 1e9, 3), per_step_ms=round(d * 1e3, 3))


def batch_limits(cfg: VerifierConfig) -> BatchLimits:
    """What one forward pass takes (the scheduler's limits, which SmartSpec prices too). With
    ``--backend vllm`` SmartSpec's split into forwards is an approximation: vLLM keeps sessions
    beyond its max_num_seqs waiting rather than taking turns, and its token budget is at least
    the model's context length."""
    return BatchLimits(cfg.capacity.max_batch_sessions, cfg.capacity.max_batch_tokens)


def make_allocator_for(cfg: VerifierConfig, estimator: StepTimeEstimator) -> Allocator:
    b, most = cfg.budgets, cfg.rounds.max_draft_tokens
    policy = make_allocator(b.allocation, AllocationSettings(
        cfg.rounds.draft_len, cfg.capacity.draft_capacity,
        min(most, b.smartspec_max_len) if b.allocation.startswith("smartspec") else most,
        b.allocation_seed if b.allocation_seed >= 0 else None,
        batch_limits(cfg), b.smartspec_timed_waits), estimator,
        estimator.overhead if b.smartspec_overhead else None)
    # the guard is fed by the torch core's steps (``DraftBudgets.served``); vLLM's core runs none of them
    if not (b.speculation_guard and b.allocation.startswith("smartspec") and cfg.target.backend == "torch"):
        return policy

    def target_only_step(sessions: float, context: float) -> float | None:
        forward = estimator.target_only.predict(sessions, context)
        return None if forward is None else forward + max(0.0, estimator.overhead.predict(sessions))

    return PaysGuard(policy, target_only_step)


def load_runner(cfg: VerifierConfig) -> tuple[LoadedModel, ModelRunner]:
    """The target and its runner. Under ``--dtype auto`` on a CPU, where bfloat16's matmuls are
    batch-invariant at no row multiple (oneDNN's on a Xeon VM whose CPU lists AMX, 2026-12-05, in an
    image without the compiler that builds the row-wise kernel), the target runs in float32, with
    one log line, rather than not at all."""
    loaded = load_model(cfg.target.model, cfg.target.device, cfg.target.dtype, cfg.target.max_model_len)
    dtype = next(loaded.model.parameters()).dtype
    cpu = cfg.target.device == "cpu"
    log.info("target dtype", dtype=str(dtype).removeprefix("torch."), asked=cfg.target.dtype,
             native_bf16_cpu=cpu_has_native_bf16() if cpu else None)
    try:
        return loaded, _runner(cfg, loaded)
    except NotInvariantError as exc:
        if not (cpu and cfg.target.dtype == "auto" and dtype == torch.bfloat16):
            raise
        log.warning("bfloat16 matmuls are not batch-invariant here; the target runs in float32", reason=str(exc))
    loaded = load_model(cfg.target.model, cfg.target.device, "float32", cfg.target.max_model_len)
    return loaded, _runner(cfg, loaded)


def _runner(cfg: VerifierConfig, loaded: LoadedModel) -> ModelRunner:
    try:
        return ModelRunner(loaded, kv_budget_bytes(cfg), cfg.engine.runner,
                           batch_invariant=cfg.engine.batch_invariant, matmul=cfg.engine.matmul)
    except KVError as exc:
        raise ModelLoadError(f"cannot set up the KV cache: {exc}") from None


def build(cfg: VerifierConfig, loop: asyncio.AbstractEventLoop) -> tuple[Hub, VerifierCore]:
    """Load the target and wire engine core, policies, output and hub together."""
    validate(cfg)  # ConfigError, before anything is loaded (main has checked already; callers in code may not)
    if cfg.target.backend == "vllm":
        return build_vllm(cfg)
    if cfg.target.torch_threads > 0:
        torch.set_num_threads(cfg.target.torch_threads)
    loaded, runner = load_runner(cfg)
    hub, output, metrics = _hub(cfg, loaded)
    hub.engine = EngineInfo("torch", loaded.name, str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
                            cfg.target.device)
    estimator, tracker = make_estimator(cfg), GoodputTracker(cfg.budgets.goodspeed_eta, cfg.budgets.goodspeed_beta)
    if not cfg.engine.estimator_file and cfg.engine.calibrate_estimator:
        calibrate_estimator(runner, estimator, loaded.max_model_len)
    slo = cfg.batches.slo_tokens_per_s if cfg.batches.slo_tokens_per_s > 0 else None
    try:
        batcher = make_batcher(cfg.batches.batching, estimator, slo, delta_s=cfg.batches.wisp_delta_ms / 1000,
                               network_s=cfg.batches.wisp_network_ms / 1000)
        trim = make_trim(cfg.batches.trim, cfg.batches.tpot_slo_ms / 1000 if cfg.batches.tpot_slo_ms > 0 else None)
        allocator = make_allocator_for(cfg, estimator)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    scheduler = Scheduler(batcher, batch_limits(cfg), cfg.capacity.prefill_chunk,
                          estimator, trim, tracker, fill=make_fill(cfg.rounds.fill, cfg.rounds.fill_riders))
    threaded = core_threaded(cfg.engine.core_mode)

    def deliver(results: list[Result]) -> None:
        if threaded:  # called on the core's thread
            loop.call_soon_threadsafe(output.on_results, results)
        else:
            output.on_results(results)

    limits = CoreLimits(cfg.rounds.max_draft_tokens, cfg.rounds.draft_timeout_s, cfg.capacity.max_waiting,
                        default_slo_tokens_per_s=slo, recompute_context=cfg.engine.recompute_context,
                        share_prefixes=cfg.engine.share_prefixes, race=cfg.rounds.sampling == "race")
    core = TorchCore(runner, loaded.eos_ids, allocator, scheduler, limits, deliver, metrics, threaded=threaded)
    return _connect(hub, output, core, loaded, cfg.rounds.resume_grace_s), core


def build_vllm(cfg: VerifierConfig) -> tuple[Hub, VerifierCore]:
    """The same services around vLLM: it loads the weights and runs every step."""
    from services.verifier.vllm_engine.core import VllmCore, VllmLimits
    from services.verifier.vllm_engine.engine import EngineSettings, EngineTarget, start_engine

    loaded = load_target_info(cfg.target.model, cfg.target.max_model_len)
    hub, output, metrics = _hub(cfg, loaded)
    hub.engine = EngineInfo("vllm", loaded.name, cfg.target.dtype, cfg.target.device)
    try:
        allocator = make_allocator_for(cfg, StepTimeEstimator())
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    t = cfg.target
    engine = start_engine(EngineSettings(
        EngineTarget(t.model, t.device, t.dtype, loaded.max_model_len, t.vllm_memory_share, t.tensor_parallel_size),
        cfg.rounds.max_draft_tokens, cfg.capacity.max_batch_sessions, cfg.capacity.max_batch_tokens))
    metrics.include_vllm()
    limits = VllmLimits(cfg.rounds.max_draft_tokens, cfg.capacity.max_sessions, loaded.vocab_size, loaded.max_model_len)
    tracker = GoodputTracker(cfg.budgets.goodspeed_eta, cfg.budgets.goodspeed_beta)
    core = VllmCore(engine, loaded.eos_ids, allocator, tracker, limits, output.on_results, metrics)
    return _connect(hub, output, core, loaded, cfg.rounds.resume_grace_s), core


def _hub(cfg: VerifierConfig, loaded: LoadedModel) -> tuple[Hub, Output, VerifierMetrics]:
    metrics = VerifierMetrics()
    routes = Routes(cfg.capacity.max_sessions, keep_s=cfg.rounds.orphan_grace_s)
    try:
        credentials = Credentials(cfg.security.auth_token, cfg.security.credentials_file)
        welcome = make_welcome(loaded.name, loaded.vocabulary or loaded.fingerprint, loaded.max_model_len,
                               cfg.rounds.max_draft_tokens,
                               conditional_drafts=True, orphan_grace_s=cfg.rounds.orphan_grace_s)
        hub = Hub(welcome, credentials, routes, metrics, cfg.security.drafter_trust)
    except (CredentialsError, ValueError) as exc:
        raise ModelLoadError(str(exc)) from None
    return hub, Output(hub, routes, metrics), metrics


def _connect(hub: Hub, output: Output, core: VerifierCore, loaded: LoadedModel, resume_grace_s: float) -> Hub:
    output.core = core
    hub.intake = Intake(core, output.routes, output, loaded.tokenizer, names=hub.node_name,
                        resume_grace_s=resume_grace_s, trusted=hub.trusted)
    return hub


async def serve(cfg: VerifierConfig, ready: asyncio.Event | None = None) -> None:
    try:
        tls = server_context(cfg.security.tls_cert, cfg.security.tls_key)
    except TlsConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    hub, core = await asyncio.to_thread(build, cfg, asyncio.get_running_loop())
    core.start()
    srv = cfg.server
    server = await start_server(hub, srv.host, srv.port, tls, srv.ws_ping_interval_s, srv.ws_ping_timeout_s)
    port = server.sockets[0].getsockname()[1] if server.sockets else cfg.server.port
    log.info("verifier listening", host=cfg.server.host, port=port, tls=tls is not None, model=hub.welcome.target_model,
             max_model_len=hub.welcome.max_model_len)
    tasks = [asyncio.create_task(fleet_status_loop(hub)), asyncio.create_task(revocation_loop(hub)),
             asyncio.create_task(core.failed())]  # a core that died ends the verifier (CoreDied)
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
        await core.aclose()
        for t in tasks:
            t.cancel()
        server.close()
        await server.wait_closed()
        log.info("verifier stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(VerifierConfig, argv if argv is not None else sys.argv[1:], prog="specfleet verifier")
        validate(cfg)
    except ConfigError as exc:
        print(f"specfleet verifier: {exc}", file=sys.stderr)
        return 2
    setup_logging("verifier", cfg.server.log_level)
    log.info("starting", config=describe(cfg))
    try:
        asyncio.run(serve(cfg))
    except ModelLoadError as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    except CoreDied as exc:  # logged with its cause where it died; exit for the supervisor to restart
        print(f"specfleet verifier: {exc}; exiting so that it is restarted", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
