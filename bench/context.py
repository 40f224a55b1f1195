"""Step time against context length: ``python -m bench context`` (part of ``make bench``).

A verifier engine core runs in this process, pinned to the server CPUs, with ``--batch``
target-only sessions whose prompts are C tokens long, for each C in ``--contexts``. After the
prompts are cached it times ``--steps`` decode steps (every session gains one token per step)
and reports the median engine step (schedule + forward + accept) beside the median pure
forward of the same shape, and the same shape through transformers with a padded
DynamicCache (which copies the caches into the batch every step). Writes
``<out>/context.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.costs import hf_forward_ms, runner_forward_ms
from bench.edge import add_edge_flags, edge_from
from services.verifier.allocation import FixedAllocator
from services.verifier.batching import BatchLimits, FcfsBatcher
from services.verifier.core import CoreLimits, TorchCore
from services.verifier.core_api import AddRequest
from services.verifier.metrics import VerifierMetrics
from services.verifier.scheduler import Scheduler
from shared.fleet import parse_cpus
from shared.models import load_model
from shared.protocol import SamplingParams
from shared.runner import ModelRunner
from shared.runner.runner import kv_shape
from shared.up import resolve_models


def engine_step_ms(runner: ModelRunner, eos: set[int], batch: int, context: int, steps: int) -> float:
    """Median engine iteration (schedule, forward, accept) with ``batch`` decoding sessions at ``context``."""
    core = TorchCore(runner, eos, FixedAllocator(0), Scheduler(FcfsBatcher(), BatchLimits(batch, 1 << 20), 1 << 20),
                     CoreLimits(16, 60.0, 1024), deliver=lambda results: None, metrics=VerifierMetrics())
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(context)
    for i in range(batch):
        prompt = torch.randint(5, runner.vocab_size, (context,), generator=gen).tolist()
        core.submit(AddRequest(f"s{i}", prompt, params, speculative=False))
    core._iterate(0.0)  # admit and prefill every prompt in one step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core._iterate(0.0)
        times.append(time.perf_counter() - start)
    for req in list(core.table.requests.values()):
        core.table.retire(req)
    return 1e3 * statistics.median(times)


def measure(target: Path, batch: int, contexts: list[int], steps: int, repeats: int) -> list[dict[str, Any]]:
    loaded = load_model(target)
    per_token = kv_shape(loaded.model).bytes_per_token
    runner = ModelRunner(loaded, (batch + 1) * (max(contexts) + steps + 32) * per_token * 2)
    rows = []
    for context in tqdm(contexts, desc="contexts", unit="ctx"):
        rows.append({
            "context": context,
            "engine_step_ms": engine_step_ms(runner, loaded.eos_ids, batch, context, steps),
            "runner_forward_ms": runner_forward_ms(runner, batch, context, 1, repeats),
            "hf_padded_forward_ms": hf_forward_ms(loaded.model, batch, context, 1, repeats),
        })
    return rows


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "context.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    base = rows[0]
    lines = [f"Batch {meta['batch']} decode steps (one new token per session), {meta['when']}, {meta['edge']}.", "",
             "| context | engine step ms | vs first | pure forward ms | vs first | transformers padded ms | vs first |",
             "|---|---|---|---|---|---|---|"]
    keys = ("engine_step_ms", "runner_forward_ms", "hf_padded_forward_ms")
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f} | {r[k] / base[k]:.2f}x" for k in keys)
        lines.append(f"| {r['context']} | {cells} |")
    table = "\n".join(lines) + "\n"
    (out / "context.md").write_text(table)
    plot(rows, out / "context.png")
    return table


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ctx = [r["context"] for r in rows]
    for key, label in [("engine_step_ms", "specfleet engine step"), ("runner_forward_ms", "specfleet pure forward"),
                       ("hf_padded_forward_ms", "transformers, padded DynamicCache")]:
        ax.plot(ctx, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("tokens of context per session")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("Step time vs context, 16 sessions (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench context", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 512, 1000])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--target", default="")
    p.add_argument("--out", default="bench/results")
    add_edge_flags(p)
    args = p.parse_args(argv)
    edge = edge_from(args)
    if edge.pinned:
        os.sched_setaffinity(0, parse_cpus(edge.server_cpus))
    torch.set_num_threads(1)
    target = resolve_models(args.target, "", Path.cwd(), Path(".specfleet")).target
    rows = measure(target, args.batch, args.contexts, args.steps, args.repeats)
    meta = {"target": str(target), "batch": args.batch, "steps": args.steps, "edge": edge.describe(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(write(rows, meta, Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
