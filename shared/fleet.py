"""A whole fleet on one machine: what to start (``plan``) and a context that runs it.

``specfleet up``, the end-to-end tests and the benchmarks all start their fleets through here,
so a flag added to a service is passed the same way everywhere. Children run as
``python -m shared.cli <service> ...``; the auth token travels in the environment, not argv.

Edge emulation: with ``server_cpus`` and ``edge_cpus`` set, the verifier runs pinned to the
server CPUs (``taskset``) and the coordinator and drafters to the edge CPUs, so on one machine
the verifier has cores of its own, as the central GPU box has, and the edge's work cannot take
time from it. The benchmarks pin their load clients to the edge too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from shared.supervisor import Supervisor


@dataclass(frozen=True)
class FleetSpec:
    target: Path
    drafts: list[Path]  # one drafter process per entry (repeat a path for several of one size)
    host: str = "127.0.0.1"
    coordinator_port: int = 8000
    verifier_port: int = 8100
    redis_url: str = ""
    torch_threads: int = 1
    verifier_flags: list[str] = field(default_factory=list)
    coordinator_flags: list[str] = field(default_factory=list)
    drafter_flags: list[str] = field(default_factory=list)
    per_drafter_flags: list[list[str]] = field(default_factory=list)  # drafter i also gets entry i, if any
    drafter_metrics_ports: list[int] = field(default_factory=list)  # one per drafter; empty: no /metrics
    server_cpus: str = ""  # e.g. "0": pin the verifier here (taskset list syntax)
    edge_cpus: str = ""  # e.g. "1": pin the coordinator and drafters here
    #: an emulated edge network (bench.netns): drafters run under this prefix (a namespace) and
    #: reach the verifier and the queue at these host:port addresses (delay proxies), not directly
    edge_prefix: list[str] = field(default_factory=list)
    edge_verifier_addr: str = ""
    edge_queue_addr: str = ""  # the coordinator's queue link, or Redis (with redis_url) as the edge reaches it
    #: TLS on every link (all three set): the verifier and the coordinator serve with this certificate
    #: and key, and their clients connect over wss:// trusting only this CA (drafters --require-tls)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert and self.tls_key and self.tls_ca)


@dataclass
class Fleet:
    base_url: str  # the coordinator, e.g. http://127.0.0.1:8000
    ws_url: str  # its WebSocket token stream
    supervisor: Supervisor
    verifier_url: str = ""  # the verifier's HTTP side: /health, /metrics, /status


def connect_host(host: str) -> str:
    """Where local peers reach a server bound to ``host`` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def pinned(argv: list[str], cpus: str) -> list[str]:
    """``argv`` run on the CPUs ``cpus`` (all CPUs when empty)."""
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def parse_cpus(cpus: str) -> set[int]:
    """'0,2-3' -> {0, 2, 3} (taskset's list syntax)."""
    out: set[int] = set()
    for part in filter(None, cpus.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _via(url: str, addr: str) -> str:
    """``url`` with its host:port replaced by ``addr`` (the edge's way to it), if any."""
    if not addr:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=addr))


def plan(spec: FleetSpec) -> list[tuple[str, list[str]]]:
    """(name, argv) of every child, in start order: verifier, coordinator, drafter-1..N."""
    base = [sys.executable, "-m", "shared.cli"]
    near = connect_host(spec.host)
    threads = ["--torch-threads", str(spec.torch_threads)]
    ws = "wss" if spec.tls else "ws"
    serve_tls = ["--tls-cert", spec.tls_cert, "--tls-key", spec.tls_key] if spec.tls else []
    client_tls = ["--tls-ca", spec.tls_ca] if spec.tls else []
    verifier = [*base, "verifier", "--host", spec.host, "--port", str(spec.verifier_port),
                "--model", str(spec.target), *threads, *serve_tls, *spec.verifier_flags]
    coordinator = [*base, "coordinator", "--host", spec.host, "--port", str(spec.coordinator_port),
                   "--model", str(spec.target), "--verifier-url", f"{ws}://{near}:{spec.verifier_port}/v1/frontend",
                   *serve_tls, *client_tls, *spec.coordinator_flags]
    if spec.redis_url:
        coordinator += ["--redis-url", spec.redis_url]
    queue_url = (_via(spec.redis_url, spec.edge_queue_addr) if spec.redis_url
                 else f"{ws}://{spec.edge_queue_addr or f'{near}:{spec.coordinator_port}'}/internal/queue")
    verifier_url = f"{ws}://{spec.edge_verifier_addr or f'{near}:{spec.verifier_port}'}/v1/drafter"
    children = [("verifier", pinned(verifier, spec.server_cpus)), ("coordinator", pinned(coordinator, spec.edge_cpus))]
    for i, draft in enumerate(spec.drafts, start=1):
        metrics = (["--metrics-port", str(spec.drafter_metrics_ports[i - 1])]
                   if len(spec.drafter_metrics_ports) >= i else [])
        if metrics and spec.edge_prefix:  # scraped from the server's side of the edge network
            metrics += ["--metrics-host", "0.0.0.0"]
        children.append((f"drafter-{i}", pinned([
            *spec.edge_prefix, *base, "drafter", "--node-id", f"drafter-{i}", "--model", str(draft),
            "--verifier-url", verifier_url, "--queue-url", queue_url, *threads,
            *([*client_tls, "--require-tls", "true"] if spec.tls else []),
            *metrics, *spec.drafter_flags, *(spec.per_drafter_flags[i - 1] if len(spec.per_drafter_flags) >= i else []),
        ], spec.edge_cpus)))
    return children


def child_env(auth_token: str, torch_threads: int) -> dict[str, str]:
    env = {"SPECFLEET_AUTH_TOKEN": auth_token, "PYTHONUNBUFFERED": "1"}
    if torch_threads > 0:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return env


@contextmanager
def running_fleet(spec: FleetSpec, log_dir: Path, auth_token: str, ready_timeout_s: float = 180.0) -> Iterator[Fleet]:
    """Start every child, wait for the coordinator's /ready, yield, then stop them all."""
    sup = Supervisor(log_dir)
    try:
        for name, argv in plan(spec):
            sup.start(name, argv, child_env(auth_token, spec.torch_threads))
        http = "https" if spec.tls else "http"
        base_url = f"{http}://{connect_host(spec.host)}:{spec.coordinator_port}"
        sup.wait_ready(f"{base_url}/ready", ready_timeout_s, verify=spec.tls_ca or True)
        verifier_url = f"{http}://{connect_host(spec.host)}:{spec.verifier_port}"
        ws_url = base_url.replace(f"{http}://", "wss://" if spec.tls else "ws://", 1) + "/v1/stream"
        yield Fleet(base_url, ws_url, sup, verifier_url)
    finally:
        sup.stop()
