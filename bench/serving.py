"""Serving benchmark (``make bench``): target-only vs speculation, raw model costs, one run.

    python -m bench.serving [--repeats 3] [--requests 16] [--max-tokens 128] [--concurrency 1,4,16]
                            [--draft-len 4] [--target DIR] [--draft DIR] [--server-cpus 0 --edge-cpus 1 | --no-pin]

In one run, on one machine, with the edge emulated by pinning (``bench.edge``):

1. raw model costs, in pinned child processes: the target's plain transformers greedy loop
   (the model's raw decode rate) and the same loop on specfleet's runner, and pure forwards of
   the shapes the targets need; the draft's forward on the edge CPU;
2. real fleets, all up at once: target-only serving, and 1 drafter (the smallest draft, default
   draft mode, k = ``--draft-len``) with its defaults and with one feature off at a time
   (``scenarios``), at every concurrency,
   ``--repeats`` times with the scenarios interleaved, with unseeded requests at
   ``--temperature``; tokens/s is the median, and the ratio to target-only the median of the
   repeats' ratios (each repeat's runs minutes apart at most);
3. the fast-rounds targets, computed from those numbers (``bench.targets``).

Writes ``<out>/serving.json``, ``serving.md`` (tables and targets) and ``serving.png``
(``serving-t<T>.*`` for a temperature other than 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.edge import Edge, edge_from, run_pinned
from bench.edge_drafts import gguf_step_ms
from bench.fleets import (
    BenchFleet,
    Run,
    Scenario,
    add_workload_flags,
    bench_fleet,
    domain_prompts,
    drafters_of,
    given_args,
    in_turn,
    measure,
)
from bench.plots import bars_by_concurrency
from bench.profile import smallest
from bench.targets import run_row, targets
from shared.up import resolve_models


def raw_costs(target: Path, draft: Path, k: int, edge: Edge) -> dict[str, Any]:
    shapes = f"1x128x1,1x128x{k + 1},16x128x1,16x128x{k + 1}"
    server = run_pinned("bench.costs", edge.server_cpus, ["--model", str(target), "--decode", "128",
                                                          "--shapes", shapes, "--hf-shapes", "--floor"])
    return {"target": server, "draft": draft_cost(target, draft, edge)}


def draft_cost(target: Path, draft: Path, edge: Edge) -> dict[str, Any]:
    """The draft's one-row forward on the edge CPU: a model directory's at 128 tokens of context
    (``bench.costs``), a GGUF file's batch-1 step after a chat prompt on the backend a drafter runs
    it on (``bench.edge_drafts --gguf-step``), as ``forward_ms["1x128x1"]`` either way."""
    if draft.suffix == ".gguf":
        return {"forward_ms": {"1x128x1": gguf_step_ms(target, str(draft), edge)}, "gguf_step": True}
    return run_pinned("bench.costs", edge.edge_cpus, ["--model", str(draft), "--decode", "128", "--shapes", "1x128x1"])


def scenarios(draft: Path, k: int, branches: Sequence[int] = (), temperature: float = 0.0) -> list[Scenario]:
    """Target-only, one drafter with its defaults, and beside it the same drafter with one feature
    off at a time, so each one's gain shows in the same run: one per value of ``branches`` (the
    drafter's ``--lookahead-branches``: alternative lookaheads after a rejection; 0 keeps the
    all-accepted one alone), no conditional drafts (lookaheads wait for their verdicts), no fill
    (the verifier idles while drafts travel), at temperature > 0 stream sampling (q on the wire,
    the verifier's own random stream) instead of races, and no pipelined drafting at all."""
    def named(n: int) -> str:
        return "all-accepted lookahead only" if n == 0 else f"{n} alternative lookahead{'s' * (n > 1)}"

    def drafter(name: str, drafter_flags: tuple[str, ...] = (), verifier_flags: tuple[str, ...] = ()) -> Scenario:
        return Scenario(f"1 drafter k={k}{name}", drafters=1, draft=str(draft), draft_len=k,
                        drafter_flags=drafter_flags, verifier_flags=verifier_flags)

    stream = [drafter(", stream sampling", verifier_flags=("--sampling", "stream"))] if temperature > 0 else []
    return [Scenario("target-only"), drafter(""),
            *[drafter(f", {named(n)}", ("--lookahead-branches", str(n))) for n in branches],
            drafter(", no conditional drafts", ("--conditional-drafts", "false")),
            drafter(", no fill", verifier_flags=("--fill", "false")), *stream,
            drafter(", no pipelining", ("--pipeline-sessions", "0"))]


def run_all(target: Path, scs: list[Scenario], args: argparse.Namespace, edge: Edge,
            interleave: bool = False) -> list[Run]:
    """Measure every scenario at every concurrency, ``args.repeats`` times: one fleet after another,
    or, with ``interleave``, every fleet up at once and each repeat measuring them in turn, so a
    drift in the machine's speed over minutes (up to 30 % here) hits every scenario alike rather
    than whichever ran during it. An interleaved fleet is primed before each window (``prime``)."""
    total = len(scs) * len(args.concurrency) * args.repeats
    with tqdm(total=total, desc="bench serving", unit="run") as bar, tempfile.TemporaryDirectory() as logs:
        if interleave:
            return _interleaved(target, scs, args, edge, Path(logs), bar)
        runs: list[Run] = []
        for sc in scs:
            bar.set_postfix_str(sc.name)
            with bench_fleet(target, sc, edge, Path(logs)) as bf:
                for conc in args.concurrency:
                    runs.append(measure(bf, sc, conc, args.repeats, max(args.requests, conc), args.max_tokens,
                                        target.name, args.temperature, domain_prompts(args.domains),
                                        args.arrival_rate, args.seed, args.trace))
                    bar.update(args.repeats)
        return runs


def _interleaved(target: Path, scs: list[Scenario], args: argparse.Namespace, edge: Edge, logs: Path,
                 bar: tqdm) -> list[Run]:
    def one(bf: BenchFleet, sc: Scenario, conc: int, i: int) -> Run:
        run = measure(bf, sc, conc, 1, max(args.requests, conc), args.max_tokens, target.name, args.temperature,
                      domain_prompts(args.domains), args.arrival_rate, args.seed + i, args.trace)
        bar.update(1)
        return run

    done = in_turn(target, scs, edge, logs, args.concurrency, args.repeats, target.name, args.temperature, one,
                   bar.set_postfix_str)
    return [run for _, _, run in done]


def paired_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's speed over target-only at its concurrency, repeat by repeat (the repeats ran side
    by side, ``run_all``): ``ratio_runs``, and their median ``ratio`` (NaN without a target-only
    repeat to pair with; a repeat without its pair is left out).

    This is not the ratio of the two medians the table also shows."""
    base = {r["concurrency"]: r["tokens_per_s_runs"] for r in rows if r["scenario"] == "target-only"}
    for r in rows:
        ref = base.get(r["concurrency"], [])
        runs = [x / y for x, y in zip(r["tokens_per_s_runs"], ref, strict=False) if y > 0]  # repeat i with repeat i
        r["ratio_runs"], r["ratio"] = runs, statistics.median(runs) if runs else float("nan")


def write(rows: list[dict[str, Any]], checks: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    stem = "serving" if meta["temperature"] == 0 else f"serving-t{meta['temperature']:g}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": checks}, indent=2))
    lines = [f"Command: `{meta['command']}` ({meta['when']}; {meta['edge']}).", "",
             "| scenario | concurrency | tokens/s (median) | runs | vs target-only (median of repeats) | acceptance | "
             "verifier CPU per step / forward | drafted tokens/s | draft model idle | "
             "lookaheads used (after a rejection) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{x:.0f}" for x in r["tokens_per_s_runs"])
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {runs} | {r['ratio']:.2f}x | "
                     f"{r['acceptance']:.3f} | {r['cpu_per_step_over_forward']:.3f} | {r['drafted_tok_s']:.0f} | "
                     f"{r['draft_idle_fraction']:.2f} | {r['lookahead_used']:.0f} "
                     f"({r.get('alternatives_used', 0):.0f}) |")
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {c['value']:.3f} | {c['goal']} | {'yes' if c['met'] else 'NO'} |" for c in checks]
    lines += ["", "How each is computed:", ""] + [f"- {c['name']}: {c['how']}" for c in checks]
    text = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(text)
    plot(rows, out / f"{stem}.png", meta["temperature"])
    return text


def plot(rows: list[dict[str, Any]], path: Path, temperature: float) -> None:
    bars_by_concurrency(rows, "tokens_per_s", path, "generated tokens/s (median)",
                        f"specfleet serving at temperature {temperature:g}, edge emulated by pinning (same run)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--draft", default="", help="draft model dir or GGUF file (default: the smallest draft beside "
                                               "the target)")
    p.add_argument("--lookahead-branches", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="also measure the drafter with each of these --lookahead-branches (its default is 1)")
    add_workload_flags(p, concurrency=(1, 4, 16))  # --temperature T != 0 writes serving-t<T>.*
    args = p.parse_args(argv)
    edge = edge_from(args)
    edge.pin_self_to_edge()
    models = resolve_models(args.target, args.draft, Path.cwd(), Path(".specfleet"))
    draft = smallest(models.drafts)
    print(f"raw model costs ({edge.describe()}) ...", flush=True)
    costs = raw_costs(models.target, draft, args.draft_len, edge)
    # an emulated edge network is one namespace per fleet, named by this process: one fleet at a time then
    if edge.networked:
        print("emulated edge network: the scenarios run one after another, not interleaved", flush=True)
    runs = run_all(models.target, scenarios(draft, args.draft_len, args.lookahead_branches, args.temperature), args,
                   edge, interleave=not edge.networked)
    rows = [run_row(r, drafters_of(r) if r.scenario != "target-only" else None) for r in runs]
    paired_ratios(rows)
    meta = {"command": "python -m bench.serving " + " ".join(given_args(argv)), "target": str(models.target),
            "draft": str(draft), "repeats": args.repeats, "requests": args.requests, "max_tokens": args.max_tokens,
            "draft_len": args.draft_len, "temperature": args.temperature,
            "edge": edge.describe(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "costs": costs}
    print(write(rows, targets(rows, costs, args.draft_len), meta, Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
