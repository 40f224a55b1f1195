"""A GGUF draft's step per row, by rows and context: ``python -m bench draft-steps``.

On specfleet's 4-bit kernel, for each KV cache dtype in ``--kv-caches`` (the drafter's ``--gguf-kv-cache``):
``--rows`` sessions each with ``--contexts`` tokens cached take one-token steps together (as a drafter
drafts for several sessions), one thread, in a child pinned to the edge CPU. Prints and writes
``<out>/draft-steps.{json,md}``: the median step over ``--steps`` steps and its milliseconds per row.

    python -m bench draft-steps [--rows 1,8] [--contexts 20,200,400,800] [--kv-caches float16,float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.edge import add_edge_flags, edge_from, run_pinned
from bench.fleets import run_meta, write_results
from shared.gguf_copies import copy_path
from shared.up import resolve_models
from training.evaluate_gguf import cpu_flag_summary


def step_ms(path: str, kv: str, rows: int, context: int, steps: int) -> float:
    """Median milliseconds of one step of ``rows`` sessions, one new token each, over ``context`` cached."""
    import torch

    from shared.gguf_files import read_gguf
    from shared.runner.gguf_backend import kv_cache_dtype, q4_runner
    from shared.runner.step import Segment

    torch.set_num_threads(1)
    info = read_gguf(path)
    runner = q4_runner(info, rows * (context + steps + 1) * info.kv_bytes_per_token * 2, self_check=False,
                       kv_dtype=kv_cache_dtype(kv))
    prompt = [100 + (i % 20000) for i in range(context)]
    slots = [runner.kv.allocate(context + steps + 1) for _ in range(rows)]
    for slot in slots:
        runner.forward([Segment(slot, prompt, context)])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.forward([Segment(slot, [5 + i], 0) for slot in slots])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench draft-steps", description=__doc__.splitlines()[0])
    p.add_argument("--width", default="Q4_1", help="which GGUF copy of the target (Q4_1 or Q8_0)")
    p.add_argument("--rows", default="1,8", help="sessions stepped together (comma list)")
    p.add_argument("--contexts", default="20,200,400,800", help="tokens cached per session (comma list)")
    p.add_argument("--kv-caches", default="float16,float32", help="KV cache dtypes (comma list)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--target", default="")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a pinned child: "path,kv,rows,context,steps"
    add_edge_flags(p)
    args = p.parse_args(argv)
    if args.one:
        path, kv, rows, context, steps = args.one.split(",")
        print(json.dumps({"step_ms": step_ms(path, kv, int(rows), int(context), int(steps))}))
        return 0
    edge = edge_from(args)
    target = resolve_models(args.target, "", Path.cwd(), Path(".specfleet")).target
    path = str(copy_path(target, args.width))
    results: list[dict[str, Any]] = []
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            for kv in args.kv_caches.split(","):
                one = f"{path},{kv},{rows},{context},{args.steps}"
                ms = float(run_pinned("bench.draft_steps", edge.edge_cpus, ["--one", one])["step_ms"])
                results.append({"rows": rows, "context": context, "kv_cache": kv, "step_ms": ms, "row_ms": ms / rows})
                print(f"rows {rows:2d}, context {context:4d}, {kv}: {ms:6.2f} ms a step, {ms / rows:5.2f} a row",
                      flush=True)
    meta = run_meta("draft-steps", argv, edge, cpu=cpu_flag_summary(), width=args.width)
    lines = [f"Command: `{meta['command']}` ({meta['when']}; {meta['edge']}; {meta['cpu']}; the "
             f"{args.width} copy on specfleet's 4-bit kernel, one thread).", "",
             "| rows | context | KV cache | step ms | ms a row |", "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['context']} | {r['kv_cache']} | {r['step_ms']:.2f} | {r['row_ms']:.2f} |"
              for r in results]
    write_results(Path(args.out), "draft-steps", {"meta": meta, "results": results}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
