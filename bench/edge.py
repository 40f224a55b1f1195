"""Edge emulation on one machine: the verifier gets CPUs of its own, the edge gets the rest.

Every benchmark takes ``--server-cpus`` and ``--edge-cpus`` (taskset list syntax; defaults
"0" and "1" on a machine with at least two CPUs) and ``--no-pin`` to run unpinned. The
verifier (and target-only serving) runs on the server CPUs; the coordinator, the drafters
and the load client run on the edge CPUs. Raw model costs are measured in pinned child
processes on the same CPUs, in the same run, so every ratio compares like with like.

``--rtt-ms`` (and ``--edge-mbit``, ``--jitter-ms``) also put the drafters behind an emulated
network: a namespace of their own joined by a shaped veth pair, latency from a delay proxy
(``bench.netns``); ``--no-netns`` keeps them on loopback behind the proxy alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any

from shared.fleet import parse_cpus, pinned

#: environment variables that limit oneDNN's and MKL's instruction sets (to measure an AVX2 machine's kernels)
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_stem(base: str) -> str:
    """The results file a runner benchmark on this machine writes: ``base`` on a CPU with native
    bfloat16 (what dtype auto serves bfloat16 on), ``base-no-bf16`` on one without, and
    ``base-isa-limited`` with :data:`ISA_LIMITS` set, so one kind of host never overwrites another's."""
    from shared.models import cpu_has_native_bf16  # torch: only when a benchmark writes its results

    if any(k in os.environ for k in ISA_LIMITS):
        return f"{base}-isa-limited"
    return base if cpu_has_native_bf16() else f"{base}-no-bf16"


@dataclass(frozen=True)
class Edge:
    server_cpus: str  # "" when not pinned
    edge_cpus: str
    rtt_ms: float = 0.0  # added between drafters and the server (0 and no rate: no edge network)
    rate_mbit: float = 0.0  # each direction of the drafters' link (0: unshaped)
    jitter_ms: float = 0.0
    netns: bool = True  # drafters in a namespace of their own (else loopback behind the proxy)
    redis: bool = False  # the request queue in a real redis-server, reached by the drafters over the edge link

    @property
    def networked(self) -> bool:
        return self.rtt_ms > 0 or self.rate_mbit > 0 or self.jitter_ms > 0

    @property
    def pinned(self) -> bool:
        return bool(self.server_cpus)

    def pin_self_to_edge(self) -> None:
        """The load client runs at the edge, beside the coordinator and drafters."""
        if self.edge_cpus:
            os.sched_setaffinity(0, parse_cpus(self.edge_cpus))

    def describe(self) -> str:
        if not self.pinned:
            return "not pinned: every process may use every CPU"
        queue = "; queue in Redis" if self.redis else ""
        return (f"verifier on CPU {self.server_cpus}; coordinator, drafters and load client on CPU "
                f"{self.edge_cpus}{queue}")

    def with_rtt(self, rtt_ms: float) -> Edge:
        return replace(self, rtt_ms=rtt_ms)


def add_edge_flags(p: argparse.ArgumentParser) -> None:
    two = len(os.sched_getaffinity(0)) >= 2
    p.add_argument("--server-cpus", default="0" if two else "", help="CPUs of the verifier (taskset syntax)")
    p.add_argument("--edge-cpus", default="1" if two else "", help="CPUs of the coordinator, drafters, client")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything (no edge emulation)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time added between drafters and server")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="extra round-trip jitter, uniform in [0, this]")
    p.add_argument("--edge-mbit", type=float, default=0.0, help="drafters' link bandwidth, each way (0: unshaped)")
    p.add_argument("--no-netns", action="store_true", help="keep drafters on loopback behind the delay proxy")
    p.add_argument("--redis", action="store_true", help="queue requests in a real redis-server (pinned with the "
                   "coordinator; drafters reach it over the edge link) instead of the coordinator's queue link")


def edge_from(args: argparse.Namespace) -> Edge:
    net = {"rtt_ms": args.rtt_ms, "rate_mbit": args.edge_mbit, "jitter_ms": args.jitter_ms, "netns": not args.no_netns,
           "redis": args.redis}
    if args.no_pin or not args.server_cpus or not args.edge_cpus:
        return Edge("", "", **net)
    return Edge(args.server_cpus, args.edge_cpus, **net)


def run_pinned(module: str, cpus: str, args: list[str], timeout_s: float = 1800.0) -> Any:
    """Run ``python -m module args`` on ``cpus`` and return the last JSON object it prints."""
    argv = pinned([sys.executable, "-m", module, *args], cpus)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{module} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    for line in reversed(out.stdout.strip().splitlines()):  # the last JSON line: libraries may log after it
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{module} printed no JSON result:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
