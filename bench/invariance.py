"""What batch invariance costs: the verifier's forward with and without it, side by side.

    python -m bench invariance [--model DIR] [--dtypes float32,bfloat16] [--repeats 15]

For each dtype, two runners over the same weights (``batch_invariant`` off and on) time one
forward of each step shape ``BxN`` (B sessions of 128 cached tokens, N new tokens each): the
decode steps of target-only serving (N = 1) and the verification steps of speculation (N = 5),
alone and batched. Runs alternate between the two runners, so noise from a shared CPU hits both;
each number is a median. One torch thread, pinned to CPU 0 when the machine has two or more (the
verifier's core in the benchmarks). Writes ``bench/results/invariance.{json,md}``; with
``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` set (an AVX2 machine's kernels, emulated),
``invariance-isa-limited.{json,md}``; on a machine without native bfloat16,
``invariance-no-bf16.{json,md}``. The attention multiple is the row count batch-invariant
attention pads a key block's rows to ("rows": one row at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.edge import ISA_LIMITS, machine_stem
from shared.model_import import DEFAULT_MODEL, fetch_model
from shared.models import cpu_has_native_bf16, load_model
from shared.runner import ModelRunner, Segment
from shared.runner.runner import kv_shape
from training.evaluate_gguf import cpu_flag_summary

SHAPES = ((1, 1), (1, 5), (4, 1), (4, 5), (16, 1), (16, 5))
CONTEXT = 128
OUT = Path("bench/results")
@torch.inference_mode()
def step_ms(runner: ModelRunner, sessions: int, new: int) -> float:
    slots = [runner.kv.allocate(CONTEXT + new) for _ in range(sessions)]
    try:
        segments = []
        for i, slot in enumerate(slots):
            assert slot is not None
            runner.forward([Segment(slot, [(7 * i + j) % 1000 + 10 for j in range(CONTEXT)], CONTEXT)])
            segments.append(Segment(slot, [11 + i] * new, 0))
        start = time.perf_counter()
        runner.forward(segments)
        return (time.perf_counter() - start) * 1e3
    finally:
        for slot in slots:
            if slot is not None:
                runner.kv.free(slot)


def measure(model_dir: Path, dtype: str, repeats: int) -> list[dict[str, Any]]:
    loaded = load_model(model_dir, dtype=dtype)
    budget = 40 * (CONTEXT + 64) * kv_shape(loaded.model).bytes_per_token
    runners = {False: ModelRunner(loaded, budget, "lean"), True: ModelRunner(loaded, budget, "lean",
                                                                              batch_invariant=True)}
    rows = []
    for sessions, new in SHAPES:
        times: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(repeats + 2):
            for invariant, runner in runners.items():
                ms = step_ms(runner, sessions, new)
                if rep >= 2:  # two warm-up rounds
                    times[invariant].append(ms)
        plain, inv = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"dtype": dtype, "sessions": sessions, "new_tokens": new, "plain_ms": round(plain, 2),
                     "invariant_ms": round(inv, 2), "cost": round(inv / plain - 1, 4),
                     "row_multiple": runners[True].row_multiple,
                     "attention_multiple": runners[True].attention_multiple})
        print(f"{dtype} {sessions}x{new}: plain {plain:.2f} ms, invariant {inv:.2f} ms ({inv / plain - 1:+.1%})",
              flush=True)
    return rows


def write(rows: list[dict[str, Any]], model: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"model": model, "context": CONTEXT, "machine": platform.processor() or platform.machine(),
            "native_bf16": cpu_has_native_bf16(), "cpu": cpu_flag_summary(), "threads": 1,
            "isa_limits": {k: os.environ[k] for k in ISA_LIMITS if k in os.environ},
            "time": time.strftime("%Y-%m-%d %H:%M")}
    stem = machine_stem("invariance")
    (OUT / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# What batch invariance costs ({meta['time']})", "",
             f"{model}, one forward at {CONTEXT} tokens of cached context per session, one thread, median "
             f"of alternating runs; {meta['cpu']}, native bfloat16: {meta['native_bf16']}"
             + (f"; kernels limited to {meta['isa_limits']} (an AVX2 machine emulated)" if meta["isa_limits"] else "")
             + ".", "",
             "| dtype | sessions × new tokens | plain ms | invariant ms | cost | row multiple | attention multiple |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['sessions']} × {r['new_tokens']} | {r['plain_ms']} | {r['invariant_ms']} | "
              f"{r['cost']:+.1%} | {r['row_multiple']} | {r.get('attention_multiple', 0) or 'rows'} |" for r in rows]
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench invariance", description=__doc__)
    p.add_argument("--model", default="", help="target model directory (default: SmolLM2-135M-Instruct, fetched)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    model = Path(args.model) if args.model else fetch_model(DEFAULT_MODEL, Path(".specfleet"))
    rows = [row for dtype in args.dtypes.split(",") for row in measure(model, dtype, args.repeats)]
    write(rows, model.name)
    return 0
