"""The emulated edge network: drafters in a network namespace of their own, behind a delay proxy.

    with edge_network(rtt_ms=40, rate_mbit=20, targets={"verifier": 8100, "queue": 8000}) as net:
        net.prefix        # ["ip", "netns", "exec", "sf-edge-1234"]: run a drafter at the edge
        net.addr["verifier"]  # "10.77.0.1:41234": where the edge reaches the verifier

One namespace holds the edge (the drafters); a veth pair joins it to the server's namespace,
with addresses 10.77.0.1 (server side) and 10.77.0.2 (edge side), and a ``tc`` token bucket
(``tbf``) shapes each direction to ``rate_mbit``. This kernel has no netem, so latency and
jitter come from a delay proxy (``bench.delay_proxy``, a process of its own) that listens on
the server side's address and forwards to each service on loopback: edge traffic crosses the
veth (bandwidth) and the proxy (RTT). The harness creates and removes all of it; traffic only
ever goes to loopback and to these addresses.

Without root or ``ip netns`` (a container without CAP_NET_ADMIN, say), it falls back to the
proxy alone on loopback: the RTT is still there, the bandwidth limit is not, and
:attr:`EdgeNet.mode` says so (the results record it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.fleet import pinned
from shared.up import free_port

SERVER_IP, EDGE_IP = "10.77.0.1", "10.77.0.2"


@dataclass
class EdgeNet:
    mode: str  # "netns" or "loopback" (and why)
    rtt_ms: float
    rate_mbit: float
    prefix: list[str] = field(default_factory=list)  # run a command inside the edge namespace
    addr: dict[str, str] = field(default_factory=dict)  # service -> host:port the edge connects to
    edge_host: str = "127.0.0.1"  # where the server side reaches services running at the edge
    rtts: dict[str, float] = field(default_factory=dict)  # services reached at an RTT of their own

    def describe(self) -> str:
        shaped = f", {self.rate_mbit:g} Mbit/s each way" if self.rate_mbit and self.mode == "netns" else ""
        own = "".join(f", {name} +{rtt:g} ms" for name, rtt in sorted(self.rtts.items()))
        return f"edge network: {self.mode}, RTT +{self.rtt_ms:g} ms{own}{shaped}"


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True)


def why_no_netns() -> str:
    """'' when this process can create network namespaces; otherwise the reason."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "not root"
    name = f"sf-probe-{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns add failed: {getattr(exc, 'stderr', '') or exc}".strip()
    _run("ip", "netns", "del", name)
    return ""


def remove_stale() -> list[str]:
    """Remove edge namespaces left by benchmark processes that died without cleaning up (a
    kill): their veth pair still holds the server address and would capture the new link's
    traffic. Returns the names removed."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    stale = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name.removeprefix("sf-edge-")
        if name.startswith("sf-edge-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove(name)
            stale.append(name)
    return stale


def _create(name: str, rate_mbit: float) -> None:
    host_dev, edge_dev = f"sfv{os.getpid() % 100000}", f"sfe{os.getpid() % 100000}"
    _run("ip", "netns", "add", name)
    _run("ip", "link", "add", host_dev, "type", "veth", "peer", "name", edge_dev)
    _run("ip", "link", "set", edge_dev, "netns", name)
    _run("ip", "addr", "add", f"{SERVER_IP}/30", "dev", host_dev)
    _run("ip", "link", "set", host_dev, "up")
    inside = ["ip", "netns", "exec", name]
    _run(*inside, "ip", "addr", "add", f"{EDGE_IP}/30", "dev", edge_dev)
    _run(*inside, "ip", "link", "set", edge_dev, "up")
    _run(*inside, "ip", "link", "set", "lo", "up")
    if rate_mbit > 0:
        shape = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "200ms"]
        _run("tc", "qdisc", "add", "dev", host_dev, *shape)  # server -> edge
        _run(*inside, "tc", "qdisc", "add", "dev", edge_dev, *shape)  # edge -> server


def _remove(name: str) -> None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        _run("ip", "netns", "del", name)  # takes the veth pair with it


def _start_proxy(listen_host: str, target_port: int, one_way_ms: float, jitter_ms: float,
                 cpus: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    argv = pinned([sys.executable, "-m", "bench.delay_proxy", "--listen", f"{listen_host}:{port}",
                   "--target", f"127.0.0.1:{target_port}", "--delay-ms", str(one_way_ms),
                   "--jitter-ms", str(jitter_ms)], cpus)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # it prints one line once it listens
    if not line.startswith("delay proxy"):
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise RuntimeError(f"the delay proxy did not start: {line!r}")
    return proc, port


@contextlib.contextmanager
def edge_network(rtt_ms: float, rate_mbit: float, targets: dict[str, int], jitter_ms: float = 0.0,
                 cpus: str = "", use_netns: bool = True, rtts: dict[str, float] | None = None) -> Iterator[EdgeNet]:
    """The edge network for one fleet: ``targets`` maps service names to their loopback ports,
    each reached through a delay proxy of its own at ``rtts[name]`` (default ``rtt_ms``)."""
    why = why_no_netns() if use_netns else "namespaces not asked for"
    name = f"sf-edge-{os.getpid()}"
    net = EdgeNet("netns" if not why else f"loopback ({why})", rtt_ms, rate_mbit, rtts=dict(rtts or {}))
    proxies: list[subprocess.Popen[str]] = []
    try:
        if not why:
            if removed := remove_stale():
                print(f"removed edge namespaces left by dead benchmark runs: {', '.join(removed)}", file=sys.stderr)
            _create(name, rate_mbit)
            net.prefix, net.edge_host = ["ip", "netns", "exec", name], EDGE_IP
        listen = SERVER_IP if not why else "127.0.0.1"
        for service, port in targets.items():
            rtt = (rtts or {}).get(service, rtt_ms)
            proc, proxy_port = _start_proxy(listen, port, rtt / 2, jitter_ms / 2, cpus)
            proxies.append(proc)
            net.addr[service] = f"{listen}:{proxy_port}"
        yield net
    finally:
        for proc in proxies:
            proc.terminate()
        for proc in proxies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        if not why:
            _remove(name)
            time.sleep(0.1)
