"""Benchmark fleets: a scenario's real services on loopback, pinned, with their /metrics.

A scenario is target-only serving (no drafters, coordinator ``--speculation off``) or N
drafters with one draft model. The fleet starts through ``shared.fleet`` exactly as
``specfleet up`` starts it, with the verifier pinned to the server CPUs and everything else to
the edge CPUs (``bench.edge``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from bench.client import Outcome, run_arrivals, run_load
from bench.edge import Edge, add_edge_flags, edge_from
from bench.netns import edge_network
from bench.scrape import Snapshot, diff_all, merged, scrape_all
from bench.traces import TRACES, trace_arrivals
from shared.fleet import Fleet, FleetSpec, pinned, running_fleet
from shared.redis_server import private_redis
from shared.up import Models, free_port, resolve_models

L = TypeVar("L")  # a load level: a concurrency, a sweep point
#: how long a fleet's drafters may take to load their models and reach the verifier after the
#: coordinator is ready (which it is with the first)
DRAFTERS_READY_S = 120.0

PROMPTS = [
    "def read_config(path):\n", "class LRUCache:\n    def __init__(self", "import os\nimport sys\n\n",
    "    for key, value in items.items():\n", "def main(argv=None):\n", "# Parse the header\n",
    "try:\n    import json\nexcept", "    return self._", "with open(filename) as f:\n",
    "def __repr__(self):\n", "if __name__ == '__main__':\n", "raise ValueError(",
    "    @property\n    def", "lines = text.splitlines()\n", "async def fetch(", "    # Compute the",
]
PROSE_PROMPTS = [
    "The committee met on Tuesday to discuss", "It was late in the evening when the", "In the spring of that year,",
    "The village lay at the foot of", "She opened the letter and read", "Most historians agree that the",
]
QUESTION_PROMPTS = [
    "Q: How do I read a file line by line?\nA:", "Q: What does the yield keyword do?\nA:",
    "Q: Why is my loop slow?\nA:", "Q: How can I sort a dict by value?\nA:",
    "Q: What is the difference between a list and a tuple?\nA:", "Q: How do I parse JSON?\nA:",
]
#: prompt domains: drafters see different acceptance on each (the demo models learned code)
DOMAINS = {"code": PROMPTS, "prose": PROSE_PROMPTS, "question": QUESTION_PROMPTS}


def domain_prompts(domains: list[str]) -> list[str]:
    """The chosen domains' prompts, interleaved so every request mix holds all of them."""
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown prompt domain(s) {unknown}; choose from {', '.join(DOMAINS)}")
    lists = [DOMAINS[d] for d in domains]
    return [lst[i % len(lst)] for i in range(max(len(lst) for lst in lists)) for lst in lists]


#: prompts no benchmark measures with: what a policy learns from (WISP's predictor) before it is measured
TRAIN_PROMPTS = [
    "def parse_args(argv):\n", "class Node:\n    def __init__(self", "import json\nimport re\n\n",
    "    while queue:\n", "def load(path, encoding='utf-8'):\n", "# Write the results\n",
    "for i in range(len(items)):\n", "    def __eq__(self, other):\n", "with tempfile.TemporaryDirectory() as d:\n",
    "def test_roundtrip():\n", "class Config(dataclass):\n", "logger = logging.getLogger(",
    "    if not isinstance(value, int):\n", "result = {k: v for k, v in", "async def handle(request):\n",
    "    # Normalise the", "def merge(a, b):\n", "except KeyError as exc:\n", "    yield from self._",
    "total = sum(", "class Stack:\n", "def fib(n):\n", "    return sorted(", "from pathlib import Path\n\n",
]


@dataclass(frozen=True)
class Scenario:
    name: str
    drafters: int = 0  # 0: target-only
    draft: str = ""  # draft model directory (with drafters)
    draft_len: int = 4
    verifier_flags: tuple[str, ...] = ()
    drafter_flags: tuple[str, ...] = ()
    drafts: tuple[str, ...] = ()  # one draft model per drafter (overrides ``draft``)
    per_drafter_flags: tuple[tuple[str, ...], ...] = ()  # drafter i also gets entry i
    rtt_ms: float | None = None  # the drafters' RTT for this scenario (None: the run's --rtt-ms)
    drafter_rtts: tuple[float, ...] = ()  # drafter i reaches the verifier at RTT entry i (its own delay proxy)
    speculation: str = ""  # the coordinator's --speculation (empty: on with drafters, else off)
    #: the verifier's --allocation unless ``verifier_flags`` names one: a benchmark's "k = 4" is
    #: Fixed-S at ``draft_len``; empty: the verifier's own default policy (as specfleet up runs it)
    allocation: str = "fixed"


@dataclass
class Run:
    """One scenario at one concurrency: tokens/s per repeat and what the services measured."""

    scenario: str
    concurrency: int
    rates: list[float]
    outcomes: list[Outcome]
    metrics: dict[str, Snapshot] = field(default_factory=dict)
    network: str = "loopback"
    walls: list[float] = field(default_factory=list)  # seconds of each repeat
    client_cpu_s: float = 0.0  # the load client's CPU seconds (this process) over the repeats
    #: closed loop: when each socket sent its first request, per repeat (seconds from its start,
    #: in order): connecting them takes the client and the coordinator a while
    first_sends: list[list[float]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rates)

    @property
    def acceptance(self) -> float:
        drafted = sum(o.drafted for o in self.outcomes)
        return sum(o.accepted for o in self.outcomes) / drafted if drafted else 0.0


def bodies(n: int, max_tokens: int, model: str, temperature: float = 0.0,
           prompts: list[str] = PROMPTS, slo_classes: Sequence[float] = ()) -> list[dict[str, Any]]:
    """``n`` completion requests over ``prompts`` in turn; with ``slo_classes`` (tokens/s), request
    i asks for class ``slo_classes[i % len]`` (the extension field ``slo_tokens_per_s``)."""
    out: list[dict[str, Any]] = [
        {"kind": "completion", "model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
         "temperature": temperature, "ignore_eos": True} for i in range(n)]
    for i, body in enumerate(out if slo_classes else []):
        body["slo_tokens_per_s"] = slo_classes[i % len(slo_classes)]
    return out


@dataclass
class BenchFleet:
    fleet: Fleet
    urls: dict[str, str]  # service -> /metrics URL
    network: str = "loopback"  # the drafters' network, as set up (bench.netns)

    def scrape(self) -> dict[str, Snapshot]:
        return scrape_all(self.urls)


def fleet_spec(target: Path, sc: Scenario, edge: Edge) -> tuple[FleetSpec, dict[str, str]]:
    quiet = ["--log-level", "warning"]
    ports = [free_port() for _ in range(sc.drafters)]
    spec = FleetSpec(
        target=target, drafts=[Path(d) for d in sc.drafts] or [Path(sc.draft)] * sc.drafters,
        coordinator_port=free_port(),
        verifier_port=free_port(), drafter_metrics_ports=ports, server_cpus=edge.server_cpus, edge_cpus=edge.edge_cpus,
        verifier_flags=[*quiet, "--draft-len", str(sc.draft_len), *allocation_flags(sc), *sc.verifier_flags],
        coordinator_flags=[*quiet, "--speculation", sc.speculation or ("on" if sc.drafters else "off"),
                           "--max-in-flight", "0"],
        drafter_flags=[*quiet, "--max-sessions", "64", *sc.drafter_flags],
        per_drafter_flags=[list(f) for f in sc.per_drafter_flags],
    )
    urls = {"verifier": f"http://127.0.0.1:{spec.verifier_port}/metrics",
            "coordinator": f"http://127.0.0.1:{spec.coordinator_port}/metrics",
            **{f"drafter-{i + 1}": f"http://127.0.0.1:{p}/metrics" for i, p in enumerate(ports)}}
    return spec, urls


def allocation_flags(sc: Scenario) -> tuple[str, ...]:
    """``--allocation <sc.allocation>``, unless the scenario's own verifier flags choose one or it
    asks for the verifier's default."""
    if not sc.allocation or "--allocation" in sc.verifier_flags:
        return ()
    return ("--allocation", sc.allocation)


@contextmanager
def bench_fleet(target: Path, sc: Scenario, edge: Edge, log_dir: Path) -> Iterator[BenchFleet]:
    spec, urls = fleet_spec(target, sc, edge)
    edge = edge.with_rtt(sc.rtt_ms) if sc.rtt_ms is not None else edge
    network = "loopback"
    with contextlib.ExitStack() as stack:
        if edge.redis:
            port = stack.enter_context(private_redis(Path(stack.enter_context(tempfile.TemporaryDirectory())),
                                                     pinned([], edge.edge_cpus)))
            spec = replace(spec, redis_url=f"redis://127.0.0.1:{port}/0")
        if (edge.networked or sc.drafter_rtts) and sc.drafters:
            spec, urls, network = _over_edge(stack, spec, urls, sc, edge)
        fleet = stack.enter_context(running_fleet(spec, log_dir / sc.name.replace(" ", "_"),
                                                  secrets.token_urlsafe(16)))
        bf = BenchFleet(fleet, urls, network)
        for name, url in urls.items():  # the coordinator is ready with one drafter: wait for every one
            if name.startswith("drafter"):
                fleet.supervisor.wait_ready(url.replace("/metrics", "/ready"), DRAFTERS_READY_S)
        asyncio.run(run_load(fleet.ws_url, bodies(4, 16, target.name), 2))  # warm-up
        yield bf


def _over_edge(stack: contextlib.ExitStack, spec: FleetSpec, urls: dict[str, str], sc: Scenario,
               edge: Edge) -> tuple[FleetSpec, dict[str, str], str]:
    """Put the drafters behind the emulated edge network: the verifier, the queue (the
    coordinator's link or Redis), and with ``sc.drafter_rtts`` one verifier proxy per drafter."""
    queue_port = urlsplit(spec.redis_url).port if spec.redis_url else spec.coordinator_port
    assert queue_port is not None
    targets = {"verifier": spec.verifier_port, "queue": queue_port}
    own = {f"verifier-{i + 1}": rtt for i, rtt in enumerate(sc.drafter_rtts)}
    targets.update({name: spec.verifier_port for name in own})
    net = stack.enter_context(edge_network(edge.rtt_ms, edge.rate_mbit, targets, edge.jitter_ms, edge.edge_cpus,
                                           edge.netns, own))
    flags = [list(f) for f in spec.per_drafter_flags] + [[] for _ in range(len(spec.drafts))]
    for i in range(len(sc.drafter_rtts)):
        flags[i] = [*flags[i], "--verifier-url", f"ws://{net.addr[f'verifier-{i + 1}']}/v1/drafter"]
    spec = replace(spec, edge_prefix=net.prefix, edge_verifier_addr=net.addr["verifier"],
                   edge_queue_addr=net.addr["queue"], per_drafter_flags=flags[: len(spec.drafts)])
    urls = {k: v.replace("127.0.0.1", net.edge_host) if k.startswith("drafter") else v for k, v in urls.items()}
    return spec, urls, net.describe()


def measure(bf: BenchFleet, sc: Scenario, concurrency: int, repeats: int, requests: int, max_tokens: int,
            model: str, temperature: float = 0.0, prompts: list[str] = PROMPTS, arrival_rate: float = 0.0,
            seed: int = 0, trace: str = "poisson", slo_classes: Sequence[float] = ()) -> Run:
    """``repeats`` rounds of ``requests`` requests: closed loop over ``concurrency`` sockets, or,
    with ``arrival_rate`` > 0, open loop with seeded arrivals of the ``trace`` kind
    (``bench.traces``: Poisson or a bursty pattern; ``concurrency`` unused)."""
    before = bf.scrape()
    rates: list[float] = []
    walls: list[float] = []
    outcomes: list[Outcome] = []
    first_sends: list[list[float]] = []
    cpu = time.process_time()
    for i in range(repeats):
        reqs = bodies(requests, max_tokens, model, temperature, prompts, slo_classes)
        if arrival_rate > 0:
            load = run_arrivals(bf.fleet.ws_url, reqs, trace_arrivals(trace, arrival_rate, len(reqs), seed + i))
        else:
            load = run_load(bf.fleet.ws_url, reqs, concurrency)
        wall, outs = asyncio.run(load)
        rates.append(sum(o.tokens for o in outs) / wall)
        walls.append(wall)
        outcomes += outs
        if arrival_rate <= 0:  # a socket's next request starts after its first ends, long after the others' first
            first_sends.append(sorted(o.sent_s for o in outs)[:concurrency])
    cpu = time.process_time() - cpu
    return Run(sc.name, concurrency, rates, outcomes, diff_all(bf.scrape(), before), bf.network, walls, cpu,
               first_sends)


def prime(bf: BenchFleet, model: str, temperature: float = 0.0) -> None:
    """One short request, before a measurement of a fleet that sat idle while others were measured:
    the services count an idle gap when work resumes (the draft model's idle time, for one), so the
    gap lands here, outside the measured window, and every fleet starts its window warm."""
    asyncio.run(run_load(bf.fleet.ws_url, bodies(1, 4, model, temperature), 1))


def combined(runs: Sequence[Run]) -> Run:
    """Single-repeat runs of one scenario at one concurrency as one run: their rates in order,
    every outcome, and each service's metrics summed over the runs' windows."""
    first = runs[0]
    names = dict.fromkeys(name for r in runs for name in r.metrics)  # every service any run scraped, in order
    metrics = {name: merged([r.metrics[name] for r in runs if name in r.metrics]) for name in names}
    return Run(first.scenario, first.concurrency, [x for r in runs for x in r.rates],
               [o for r in runs for o in r.outcomes], metrics, first.network, [w for r in runs for w in r.walls],
               sum(r.client_cpu_s for r in runs), [x for r in runs for x in r.first_sends])


def in_turn(target: Path, scs: Sequence[Scenario], edge: Edge, logs: Path, levels: Sequence[L], repeats: int,
            model: str, temperature: float, measure_one: Callable[[BenchFleet, Scenario, L, int], Run],
            on_run: Callable[[str], None] = lambda label: None) -> list[tuple[Scenario, L, Run]]:
    """Every scenario at every level, ``repeats`` times, taking turns: every fleet up at once, and
    each repeat measuring each scenario once (``measure_one(fleet, scenario, level, repeat)``), each
    repeat starting with the next scenario, each fleet primed before its window. A drift of the
    machine's speed over minutes then hits every scenario alike. Returns each scenario's repeats
    at each level as one run (``combined``), level by level; ``on_run`` hears each window's label."""
    out: list[tuple[Scenario, L, Run]] = []
    with contextlib.ExitStack() as stack:
        fleets = []
        for sc in scs:
            on_run(f"starting {sc.name}")
            fleets.append((sc, stack.enter_context(bench_fleet(target, sc, edge, logs))))
        for level in levels:
            parts: dict[str, list[Run]] = {sc.name: [] for sc in scs}
            for i in range(repeats):
                for sc, bf in fleets[i % len(fleets):] + fleets[: i % len(fleets)]:
                    on_run(f"{sc.name} {level}")
                    prime(bf, model, temperature)
                    parts[sc.name].append(measure_one(bf, sc, level, i))
            out += [(sc, level, combined(parts[sc.name])) for sc, _ in fleets]
    return out


def add_workload_flags(p: argparse.ArgumentParser, repeats: int = 3, requests: int = 16, max_tokens: int = 128,
                       concurrency: tuple[int, ...] = (1, 4)) -> None:
    """The flags every serving benchmark shares: the workload, the target, the output folder, the edge."""
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=list(concurrency))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--domains", type=lambda s: s.split(","), default=["code"],
                   help=f"comma list of prompt domains, mixed in turn: {', '.join(DOMAINS)}")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="requests per second, Poisson (seeded by --seed); 0: closed loop at each --concurrency")
    p.add_argument("--trace", choices=TRACES, default="poisson",
                   help="open-loop arrival pattern at the mean rate: poisson, or AdaSpec Fig. 1's bursty shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="")
    p.add_argument("--out", default="bench/results")
    add_edge_flags(p)


def prepare(args: argparse.Namespace) -> tuple[Edge, Models, Path]:
    """A serving benchmark's start: pin this process (the load client) to the edge, find the
    models, make the output folder."""
    edge = edge_from(args)
    edge.pin_self_to_edge()
    models = resolve_models(args.target, "", Path.cwd(), Path(".specfleet"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return edge, models, out


def given_args(argv: list[str] | None) -> list[str]:
    """The flags a bench command ran with: ``argv``, or the command line's when run as a module."""
    return sys.argv[1:] if argv is None else argv


def run_meta(command: str, argv: list[str] | None, edge: Edge, **extra: Any) -> dict[str, Any]:
    """What a results file says about its run: the command line, when, and the edge emulation."""
    return {"command": f"python -m bench {command} " + shlex.join(given_args(argv)),
            "when": time.strftime("%Y-%m-%d %H:%M"), "edge": edge.describe(), **extra}


def write_results(out: Path, stem: str, data: dict[str, Any], lines: list[str]) -> None:
    """``<out>/<stem>.json`` (the data) and ``<out>/<stem>.md`` (the table), and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def drafters_of(run: Run) -> Snapshot:
    return merged([snap for name, snap in run.metrics.items() if name.startswith("drafter")])
