"""Serving benchmark: target-only vs speculative fleets, same workload, one run, medians.

    python -m bench.serving [--repeats 3] [--requests 16] [--max-tokens 64] [--out bench/out]

Each scenario starts a real fleet (verifier, coordinator, drafters as processes on loopback),
warms it up, then sends the same greedy requests ``--repeats`` times at each concurrency and
records tokens/s and acceptance. Results go to ``<out>/serving.json`` (default bench/results), a table to
``<out>/serving.md`` and a plot to ``<out>/serving.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.client import run_load
from shared.fleet import FleetSpec, running_fleet
from shared.up import free_port, resolve_models

PROMPTS = [
    "def read_config(path):\n", "class LRUCache:\n    def __init__(self", "import os\nimport sys\n\n",
    "    for key, value in items.items():\n", "def main(argv=None):\n", "# Parse the header\n",
    "try:\n    import json\nexcept", "    return self._", "with open(filename) as f:\n",
    "def __repr__(self):\n", "if __name__ == '__main__':\n", "raise ValueError(",
    "    @property\n    def", "lines = text.splitlines()\n", "async def fetch(", "    # Compute the",
]


@dataclass(frozen=True)
class Scenario:
    name: str
    drafters: int  # 0: target-only (coordinator --speculation off)
    draft_len: int = 4


@dataclass
class Row:
    scenario: str
    concurrency: int
    tokens_per_s: float  # median over repeats
    tokens_per_s_runs: list[float]
    p50_latency_s: float
    acceptance: float  # accepted / drafted
    mean_accepted_per_round: float


SCENARIOS = [Scenario("target-only", 0), Scenario("1 drafter k=4", 1), Scenario("2 drafters k=4", 2)]


def bodies(n: int, max_tokens: int, model: str) -> list[dict[str, Any]]:
    return [{"kind": "completion", "model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True} for i in range(n)]


def fleet_spec(target: Path, drafts: list[Path], sc: Scenario) -> FleetSpec:
    use = [drafts[-1 - (i % len(drafts))] for i in range(sc.drafters)]  # largest draft first
    quiet = ["--log-level", "warning"]
    return FleetSpec(
        target=target, drafts=use, coordinator_port=free_port(), verifier_port=free_port(),
        verifier_flags=[*quiet, "--draft-len", str(sc.draft_len)],
        coordinator_flags=[*quiet, "--speculation", "on" if sc.drafters else "off"],
        drafter_flags=[*quiet, "--max-sessions", "16"],
    )


def measure(ws_url: str, sc: Scenario, args: argparse.Namespace, model: str, bar: tqdm) -> list[Row]:
    asyncio.run(run_load(ws_url, bodies(4, 16, model), 2))  # warm-up
    rows = []
    for conc in args.concurrency:
        rates, outcomes = [], []
        for _ in range(args.repeats):
            wall, outs = asyncio.run(run_load(ws_url, bodies(args.requests, args.max_tokens, model), conc))
            rates.append(sum(o.tokens for o in outs) / wall)
            outcomes += outs
            bar.update(1)
        drafted = sum(o.drafted for o in outcomes)
        accepted = sum(o.accepted for o in outcomes)
        rounds = sum(o.tokens - o.accepted for o in outcomes)  # each round commits exactly one extra token
        rows.append(Row(sc.name, conc, statistics.median(rates), rates,
                        statistics.median(o.latency_s for o in outcomes), accepted / drafted if drafted else 0.0,
                        accepted / rounds if rounds and drafted else 0.0))
    return rows


def write(rows: list[Row], out: Path, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    base = {r.concurrency: r.tokens_per_s for r in rows if r.scenario == "target-only"}
    lines = ["| scenario | concurrency | tokens/s (median) | vs target-only | p50 latency s | acceptance | "
             "accepted/round |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.tokens_per_s / base[r.concurrency] if base.get(r.concurrency) else float("nan")
        lines.append(f"| {r.scenario} | {r.concurrency} | {r.tokens_per_s:.1f} | {ratio:.2f}x | "
                     f"{r.p50_latency_s:.2f} | {r.acceptance:.3f} | {r.mean_accepted_per_round:.2f} |")
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "serving.png")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    concs = sorted({r.concurrency for r in rows})
    names = list(dict.fromkeys(r.scenario for r in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [next((r.tokens_per_s for r in rows if r.scenario == name and r.concurrency == c), 0) for c in concs]
        ax.bar([c_i + i * width for c_i in range(len(concs))], vals, width, label=name)
    ax.set_xticks([c_i + width * (len(names) - 1) / 2 for c_i in range(len(concs))], [f"{c} concurrent" for c in concs])
    ax.set_ylabel("generated tokens/s (median)")
    ax.set_title("specfleet serving: target-only vs speculative (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=16, help="requests per repeat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--target", default="")
    p.add_argument("--drafts", default="")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    models = resolve_models(args.target, args.drafts, Path.cwd(), Path(".specfleet"))
    rows: list[Row] = []
    total = len(SCENARIOS) * len(args.concurrency) * args.repeats
    with tqdm(total=total, desc="bench serving", unit="run") as bar, tempfile.TemporaryDirectory() as logs:
        for sc in SCENARIOS:
            bar.set_postfix_str(sc.name)
            spec = fleet_spec(models.target, models.drafts, sc)
            with running_fleet(spec, Path(logs) / sc.name.replace(" ", "_"), secrets.token_urlsafe(16)) as fleet:
                rows += measure(fleet.ws_url, sc, args, models.target.name, bar)
    meta = {"target": str(models.target), "drafts": [str(d) for d in models.drafts], "repeats": args.repeats,
            "requests": args.requests, "max_tokens": args.max_tokens, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    write(rows, Path(args.out), meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
