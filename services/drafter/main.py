"""Drafter entry point: ``specfleet drafter`` (or ``python -m services.drafter.main``).

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT); 2 when retrying cannot help - a bad
flag, an unusable model directory, or a verifier that refuses this drafter's tokenizer,
protocol version or credentials (the log line says what to fix).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable
from pathlib import Path

from services.drafter.config import DrafterConfig
from services.drafter.control import CONTROLLERS, ControlSettings, make_controller
from services.drafter.control.admission import ADMISSIONS
from services.drafter.control.predicted_rejection import PredictorState
from services.drafter.control.rejection_predictor import RejectionMLP
from services.drafter.health import HealthServer
from services.drafter.link import LinkRefused, VerifierLink
from services.drafter.loop import DrafterLoop, LoopSettings
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import Proposer
from services.drafter.proposers.draft_model import DRAFT_MODES, DraftModelProposer
from services.drafter.proposers.gguf import GgufProposer, gguf_draft
from services.drafter.proposers.ngram import NgramProposer
from services.drafter.proposers.oracle import OracleProposer, load_references
from services.drafter.rounds import RoundSettings
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.config import ConfigError, describe, load_config, url_list
from shared.draft_q import Nucleus
from shared.gguf_files import gguf_file, read_gguf
from shared.log import get_logger, setup_logging
from shared.models import LoadedModel, ModelLoadError, load_model, load_vocabulary
from shared.next_tokens import NextTokens, load_table, table_beside
from shared.protocol import MAX_DRAFT_TOKENS, MAX_Q_ENTRIES, PROTOCOL_VERSION, Hello
from shared.queue import RequestQueue, open_queue
from shared.runner import ModelRunner
from shared.runner.gguf_backend import gguf_runner, kv_cache_dtype, resolve_backend
from shared.runner.runner import kv_shape
from shared.tls import TlsConfigError, client_context

log = get_logger("drafter.main")
LOG_LEVELS = ("debug", "info", "warning", "error")
AUTO_KV_RAM_SHARE = 0.2
#: a GGUF draft's KV cache when --kv-cache-gb is 0: llama.cpp commits (and zeroes) all of it when the
#: context is made, so it is not sized for every session at full context (SmolLM2: 23 KB a token, so
#: 1 GiB holds ~46k tokens, 64 sessions of 700); a session that finds no room drafts nothing
GGUF_AUTO_KV_BYTES = 1 << 30
COMPUTE_MODES = ("auto", "thread", "inline")
PROPOSERS = ("auto", "draft-model", "gguf", "ngram", "oracle")


def link_tls(cfg: DrafterConfig) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """Client TLS contexts for the verifier link and a ws(s):// queue link (None: plaintext or not a
    WebSocket queue). ConfigError for a missing CA file or, under --require-tls, a plaintext URL."""
    try:
        urls = url_list(cfg.links.verifier_url, "--verifier-url")
        # url_list: one scheme for all
        verifier = client_context(urls[0], cfg.security.tls_ca, cfg.security.require_tls)
        scheme = cfg.links.queue_url.partition("://")[0].lower()
        if scheme in ("ws", "wss"):
            return verifier, client_context(cfg.links.queue_url, cfg.security.tls_ca, cfg.security.require_tls)
        if cfg.security.require_tls and scheme in ("redis", "unix"):
            raise TlsConfigError(f"--queue-url {cfg.links.queue_url!r} is plaintext but --require-tls is set: use "
                                 "rediss:// or the coordinator's wss://.../internal/queue")
        return verifier, None
    except TlsConfigError as exc:
        raise ConfigError(str(exc)) from None


def check_config(cfg: DrafterConfig, need_model: bool = True) -> None:
    """Refuse settings that cannot work, naming the flag to fix."""
    problems = []
    if need_model and not cfg.draft_model.model:
        problems.append("--model is required: a local Hugging Face directory holding the draft model, or a GGUF file")
    try:
        url_list(cfg.links.verifier_url, "--verifier-url")
    except ConfigError as exc:
        problems.append(str(exc))
    if not 1 <= cfg.sessions.max_sessions <= 100_000:
        problems.append(f"--max-sessions must be in [1, 100000], got {cfg.sessions.max_sessions}")
    if cfg.proposal.proposer not in PROPOSERS:
        problems.append(f"--proposer must be one of {', '.join(PROPOSERS)}, got {cfg.proposal.proposer!r}")
    if not 1 <= cfg.proposal.ngram_min <= cfg.proposal.ngram_max:
        problems.append(f"--ngram-min and --ngram-max need 1 <= min <= max, got {cfg.proposal.ngram_min} "
                        f"and {cfg.proposal.ngram_max}")
    if cfg.proposal.proposer == "oracle" and not cfg.proposal.oracle_file:
        problems.append("--proposer oracle needs --oracle-file (record one with python -m bench oracle-record)")
    if not 0.0 <= cfg.proposal.oracle_alpha <= 1.0:
        problems.append(f"--oracle-alpha must be in [0, 1], got {cfg.proposal.oracle_alpha}")
    if cfg.proposal.draft_mode not in DRAFT_MODES:
        problems.append(f"--draft-mode must be one of {', '.join(DRAFT_MODES)}, got {cfg.proposal.draft_mode!r}")
    if not 0.0 < cfg.proposal.q_mass <= 1.0:
        problems.append(f"--q-mass must be in (0, 1], got {cfg.proposal.q_mass}")
    if not 1 <= cfg.proposal.q_max_entries <= MAX_Q_ENTRIES:
        problems.append(f"--q-max-entries must be in [1, {MAX_Q_ENTRIES}], got {cfg.proposal.q_max_entries}")
    if cfg.sessions.pipeline_sessions < 0:
        problems.append(f"--pipeline-sessions must be >= 0, got {cfg.sessions.pipeline_sessions}")
    if not 0 <= cfg.sessions.lookahead_branches <= MAX_DRAFT_TOKENS:
        problems.append(f"--lookahead-branches must be in [0, {MAX_DRAFT_TOKENS}], "
                        f"got {cfg.sessions.lookahead_branches}")
    if cfg.sessions.admission not in ADMISSIONS:
        problems.append(f"--admission must be one of {', '.join(ADMISSIONS)}, got {cfg.sessions.admission!r}")
    if not 0.0 <= cfg.control.threshold <= 1.0:
        problems.append(f"--threshold must be in [0, 1], got {cfg.control.threshold}")
    if cfg.control.controller not in CONTROLLERS:
        problems.append(f"--controller must be one of {', '.join(sorted(CONTROLLERS))}, got {cfg.control.controller!r}")
    problems += _wisp_problems(cfg)
    if len(cfg.node.node_id) > 128:
        problems.append("--node-id must be at most 128 characters")
    if not cfg.links.reconnect_s > 0:
        problems.append(f"--reconnect-s must be > 0, got {cfg.links.reconnect_s}")
    if cfg.draft_model.compute_mode not in COMPUTE_MODES:
        problems.append(f"--compute-mode must be one of {', '.join(COMPUTE_MODES)}, "
                        f"got {cfg.draft_model.compute_mode!r}")
    if not 0 <= cfg.draft_model.lookup_rows <= MAX_DRAFT_TOKENS:
        problems.append(f"--lookup-rows must be in [0, {MAX_DRAFT_TOKENS}], got {cfg.draft_model.lookup_rows}")
    if cfg.draft_model.next_tokens not in ("auto", "off") and not Path(cfg.draft_model.next_tokens).is_file():
        problems.append(f"--next-tokens must be auto, off or a table file (`specfleet fetch-model` writes "
                        f"<target>.next-tokens.json beside the GGUF copies); no file {cfg.draft_model.next_tokens!r}")
    if not 0 <= cfg.node.metrics_port <= 65535:
        problems.append(f"--metrics-port must be in [0, 65535], got {cfg.node.metrics_port}")
    if cfg.node.log_level.lower() not in LOG_LEVELS:
        problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {cfg.node.log_level!r}")
    if problems:
        raise ConfigError("; ".join(problems))
    link_tls(cfg)


def _wisp_problems(cfg: DrafterConfig) -> list[str]:
    problems = []
    if cfg.control.wisp_train_after < 0:
        problems.append(f"--wisp-train-after must be >= 0, got {cfg.control.wisp_train_after}")
    if cfg.control.wisp_model:
        try:
            RejectionMLP.load(Path(cfg.control.wisp_model))
        except ValueError as exc:
            problems.append(f"--wisp-model: {exc}")
    if cfg.control.wisp_samples and not Path(cfg.control.wisp_samples).parent.is_dir():
        problems.append(f"--wisp-samples: the directory of {cfg.control.wisp_samples} does not exist")
    return problems


def control_settings(cfg: DrafterConfig) -> ControlSettings:
    """One per drafter: AdaSpec's clock and calibration and WISP's predictor are shared by its sessions."""
    samples = Path(cfg.control.wisp_samples) if cfg.control.wisp_samples else None
    wisp = PredictorState(model=RejectionMLP.load(Path(cfg.control.wisp_model)) if cfg.control.wisp_model else None,
                     train_after=cfg.control.wisp_train_after, samples_path=samples)
    return ControlSettings(cfg.control.threshold, wisp=wisp)


def compute_inline(mode: str) -> bool:
    """thread / inline / auto: inline when the process may use a single CPU."""
    return mode == "inline" or (mode == "auto" and len(os.sched_getaffinity(0)) == 1)


def kv_budget_bytes(cfg: DrafterConfig, loaded: LoadedModel) -> int:
    """The draft KV arena: --kv-cache-gb, or room for max_sessions full-context sessions."""
    if cfg.draft_model.kv_cache_gb > 0:
        return int(cfg.draft_model.kv_cache_gb * 2**30)
    return _auto_kv_bytes(cfg, loaded.max_model_len, kv_shape(loaded.model).bytes_per_token)


def _auto_kv_bytes(cfg: DrafterConfig, max_model_len: int, per_token: int) -> int:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(cfg.sessions.max_sessions * max_model_len * per_token, int(ram * AUTO_KV_RAM_SHARE))


def proposer_kind(cfg: DrafterConfig) -> str:
    """--proposer, with auto resolved: gguf when --model is a GGUF file, else draft-model."""
    if cfg.proposal.proposer != "auto":
        return cfg.proposal.proposer
    return "gguf" if cfg.draft_model.model and gguf_file(cfg.draft_model.model) is not None else "draft-model"


def _load(cfg: DrafterConfig) -> LoadedModel:
    m = cfg.draft_model
    kind = proposer_kind(cfg)
    path = gguf_file(m.model) if m.model else None
    if kind == "gguf" and path is None:
        raise ModelLoadError(f"--proposer gguf needs --model to be a .gguf file, got {m.model!r}")
    model_free = kind in ("ngram", "oracle")
    if path is not None and (kind == "gguf" or model_free):  # a model-free proposer reads only the GGUF's vocabulary
        return gguf_draft(read_gguf(path))
    return load_vocabulary(m.model) if model_free else load_model(m.model, m.device, m.dtype)


def _gguf_proposer(cfg: DrafterConfig, loaded: LoadedModel) -> GgufProposer:
    info = read_gguf(loaded.path)
    threads = cfg.gguf.threads or cfg.gguf.torch_threads
    backend = resolve_backend(info, cfg.gguf.gguf_backend)
    kv_dtype = kv_cache_dtype(cfg.gguf.gguf_kv_cache)
    # llama.cpp's cache is float16 (GgufInfo.kv_bytes_per_token); the 4-bit kernel's as --gguf-kv-cache says
    per_token = info.kv_bytes_per_token * (kv_dtype.itemsize // 2 if backend == "specfleet" else 1)
    budget = (int(cfg.draft_model.kv_cache_gb * 2**30) if cfg.draft_model.kv_cache_gb > 0
              else min(GGUF_AUTO_KV_BYTES, _auto_kv_bytes(cfg, loaded.max_model_len, per_token)))
    # a sequence per session, and spares for the lookahead branches of a session alone
    sequences = cfg.sessions.max_sessions + cfg.sessions.lookahead_branches + 1
    runner = gguf_runner(info, budget, backend, threads, sequences, kv_dtype)
    p = cfg.proposal
    proposer = GgufProposer(runner, info, p.draft_mode, Nucleus(p.q_mass, p.q_max_entries),
                            cfg.sessions.share_prefixes, cfg.draft_model.lookup_rows)
    if proposer.lookup_rows:  # the table's guesses are looked-up rows: none here, no table
        proposer.next_tokens = next_tokens_table(cfg.draft_model.next_tokens, info.path, runner.vocab_size)
    return proposer


async def _proposer(cfg: DrafterConfig, loaded: LoadedModel) -> Proposer:
    kind = proposer_kind(cfg)
    if kind == "gguf":
        return await asyncio.to_thread(_gguf_proposer, cfg, loaded)
    if kind == "ngram":
        return NgramProposer(loaded.eos_ids, cfg.proposal.ngram_max, cfg.proposal.ngram_min)
    if kind == "oracle":
        try:
            refs = load_references(Path(cfg.proposal.oracle_file))
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        return OracleProposer(refs, cfg.proposal.oracle_alpha, loaded.vocab_size)
    runner = await asyncio.to_thread(ModelRunner, loaded, kv_budget_bytes(cfg, loaded), cfg.draft_model.runner)
    p = cfg.proposal
    proposer = DraftModelProposer(runner, loaded.eos_ids, p.draft_mode, Nucleus(p.q_mass, p.q_max_entries),
                                  cfg.sessions.share_prefixes, cfg.draft_model.lookup_rows)
    if proposer.lookup_rows:
        proposer.next_tokens = next_tokens_table(cfg.draft_model.next_tokens, None, runner.vocab_size)
    return proposer


def next_tokens_table(setting: str, gguf: Path | None, vocab_size: int) -> NextTokens | None:
    """--next-tokens: off, auto (the table beside a GGUF copy, when there is one) or a table file; refused
    when it holds a token id outside the draft's vocabulary (a table made for another model)."""
    if setting == "off":
        return None
    path = (table_beside(gguf) if gguf is not None else None) if setting == "auto" else Path(setting)
    if path is None or (setting == "auto" and not path.is_file()):
        return None
    table = load_table(path)
    if table.largest_id() >= vocab_size:
        raise ModelLoadError(f"the next-token table {path} holds token id {table.largest_id()}, outside the draft's "
                             f"vocabulary of {vocab_size}: it was made for another model. Remove it, pass "
                             "--next-tokens off, or remake it for this target with `specfleet fetch-model`")
    log.info("next-token table loaded: its guesses fill a lone session's free row", file=str(path),
             entries=len(table))
    return table


def lookahead_branches(cfg: DrafterConfig, proposer: Proposer) -> int:
    """--lookahead-branches, unless the proposer declines them (a GGUF draft on a CPU: see proposers/gguf.py)."""
    n = cfg.sessions.lookahead_branches
    if n and isinstance(proposer, GgufProposer) and not proposer.branches_pay:
        log.info("lookahead branches declined: llama.cpp runs on the CPU here, where a branch's rows cost as much as "
                 "the draft's own and the drafter is the bottleneck", lookahead_branches=n)
        return 0
    return n


def default_node_id() -> str:
    return f"drafter-{socket.gethostname()}-{os.getpid()}"[:128]


async def serve(
    cfg: DrafterConfig,
    ready: asyncio.Event | None = None,
    *,
    queue: RequestQueue | None = None,
    model: LoadedModel | None = None,
    on_session_end: Callable[[DraftSession], None] | None = None,
) -> None:
    """Run the drafter until cancelled. ``ready`` is set at each successful verifier handshake.

    ``queue`` and ``model`` let an embedding process (or a test) hand in ones it already has;
    by default they come from ``cfg.links.queue_url`` and ``cfg.draft_model.model``. Raises LinkRefused when the
    verifier refuses this drafter for good.
    """
    check_config(cfg, need_model=model is None)
    node_id = cfg.node.node_id or default_node_id()
    if cfg.gguf.torch_threads > 0:
        import torch

        torch.set_num_threads(cfg.gguf.torch_threads)
    loaded = model if model is not None else await asyncio.to_thread(_load, cfg)
    log.info("drafter starting", **{**describe(cfg), "node_id": node_id, "draft_model": loaded.name,
                                    "tokenizer_fingerprint": loaded.fingerprint})
    own_queue = queue is None
    verifier_tls, queue_tls = link_tls(cfg)
    links = cfg.links
    request_queue = queue or open_queue(links.queue_url, stream=links.queue_stream, group=links.queue_group,
                                        auth_token=cfg.security.auth_token, claim_idle_ms=links.claim_idle_ms,
                                        tls=queue_tls, site=(cfg.node.site or socket.gethostname())[:253])
    hello = Hello(role="drafter", node_id=node_id, protocol_version=PROTOCOL_VERSION,
                  tokenizer_fingerprint=loaded.fingerprint, model=loaded.name[:128] or "draft",
                  max_sessions=cfg.sessions.max_sessions,
                  ids_fingerprint=loaded.vocabulary.ids_fingerprint if loaded.vocabulary else "",
                  vocabulary=loaded.vocabulary.summary[:256] if loaded.vocabulary else "")
    proposer = await _proposer(cfg, loaded)
    metrics = DrafterMetrics()
    link = VerifierLink(cfg.links.verifier_url, hello, cfg.security.auth_token, tls=verifier_tls)
    http = HealthServer(metrics.registry, lambda: link.connected) if cfg.node.metrics_port else None
    if http is not None:
        http.start(cfg.node.metrics_host, cfg.node.metrics_port)
    worker = ComputeWorker(inline=compute_inline(cfg.draft_model.compute_mode))
    controls = control_settings(cfg)
    sessions = cfg.sessions
    rounds = RoundSettings(pipeline_sessions=sessions.pipeline_sessions, send_confidence=cfg.control.send_confidence,
                           lookahead_branches=lookahead_branches(cfg, proposer),
                           conditional=sessions.conditional_drafts)
    settings = LoopSettings(node_id, cfg.sessions.max_sessions, cfg.links.reconnect_s, cfg.sessions.admission, rounds)
    loop = DrafterLoop(settings, link=link, queue=request_queue, proposer=proposer, worker=worker,
                       new_controller=lambda: make_controller(cfg.control.controller, controls),
                       on_session_end=on_session_end, metrics=metrics)
    try:
        await loop.run(ready)
    finally:
        if http is not None:
            await asyncio.to_thread(http.close)
        await asyncio.to_thread(worker.shutdown)
        if isinstance(proposer, GgufProposer):
            proposer.close_model()  # llama.cpp's context and weights (the worker no longer uses them)
        controls.wisp.close()
        if own_queue:
            try:
                await request_queue.close()
            except Exception as exc:  # shutting down: the queue's connections go with the process anyway
                log.warning("closing the request queue failed at shutdown", error=repr(exc))


async def _serve_until_signalled(cfg: DrafterConfig) -> None:
    """serve(), stopped cleanly by SIGTERM or SIGINT (sessions go back to the verifier/queue)."""
    task = asyncio.create_task(serve(cfg))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("drafter stopped")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(DrafterConfig, argv, prog="specfleet drafter")
        check_config(cfg)
    except ConfigError as exc:
        print(f"specfleet drafter: error: {exc}", file=sys.stderr)
        return 2
    setup_logging("drafter", cfg.node.log_level)
    try:
        asyncio.run(_serve_until_signalled(cfg))
    except ModelLoadError as exc:
        log.error("cannot load the draft model", error=str(exc))
        return 2
    except LinkRefused as exc:
        log.error("the verifier refused this drafter; retrying cannot help, fix the configuration and restart",
                  code=exc.code, error=str(exc))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
