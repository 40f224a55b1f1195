"""The two verifier backends side by side (``python -m bench backends``): torch and vLLM, one run.

Five pinned fleets serve the same greedy workload (the edge emulated by pinning, as in
``bench.serving``): target-only and speculative (1 drafter, the smallest draft) on each of
``--backend torch`` and ``--backend vllm``, and vLLM speculative once more with drafters that send
no conditional drafts (``--conditional-drafts false``). Reported per scenario and concurrency: tokens/s
(median of the repeats), its ratio to the same backend's target-only serving, acceptance, and
forward passes per committed token (engine steps over generated tokens, read from each
verifier's /metrics: specfleet's step counter, vLLM's ``iteration_tokens_total`` count).

On a CPU, vLLM's per-step machinery costs far more than the demo target's forward, so its
absolute speed here says nothing about a GPU; the point is that it is correct and that drafts
cut its steps per token. Writes ``<out>/backends.{json,md}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.fleets import Run, Scenario, add_workload_flags, drafters_of, prepare, run_meta, write_results
from bench.profile import smallest
from bench.serving import run_all
from bench.targets import run_row

BACKENDS = ("torch", "vllm")


def scenarios(draft: Path, k: int) -> list[Scenario]:
    out = []
    for backend in BACKENDS:
        flags = ("--backend", backend, "--max-draft-tokens", str(max(k, 1)))
        out += [Scenario(f"{backend} target-only", verifier_flags=flags),
                Scenario(f"{backend} speculative", drafters=1, draft=str(draft), draft_len=k, verifier_flags=flags)]
    # vLLM outruns the edge on a CPU: how much do conditional drafts (sent before the Verdict) help it?
    out.append(Scenario("vllm speculative, no conditional drafts", drafters=1, draft=str(draft), draft_len=k,
                        verifier_flags=out[-1].verifier_flags, drafter_flags=("--conditional-drafts", "false")))
    return out


def forward_counts(run: Run, vllm: bool) -> tuple[float, float]:
    """The verifier's forward passes (a batch's counts once) and generated tokens over the run,
    from its /metrics: specfleet's step counter, or vLLM's ``iteration_tokens_total`` count."""
    v = run.metrics.get("verifier")
    if v is None:
        return 0.0, 0.0
    if vllm:
        return v.total("vllm:iteration_tokens_total_count"), v.total("vllm:generation_tokens_total")
    return v.value("specfleet_verifier_steps_total"), v.value("specfleet_verifier_generated_tokens_total")


def steps_per_token(run: Run) -> float:
    steps, tokens = forward_counts(run, run.scenario.startswith("vllm"))
    return steps / tokens if tokens else 0.0


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    base = {(r["scenario"].split()[0], r["concurrency"]): r["tokens_per_s"] for r in rows
            if r["scenario"].endswith("target-only")}
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; draft budget k = "
             f"{meta['draft_len']}).", "",
             "| scenario | concurrency | tokens/s (median) | vs same backend target-only | acceptance | "
             "forward passes per token |", "|---|---|---|---|---|---|"]
    for r in rows:
        ref = base[(r["scenario"].split()[0], r["concurrency"])]
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / ref:.2f}x | {r['acceptance']:.3f} | {r['steps_per_token']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench backends", description=__doc__.splitlines()[0])
    p.add_argument("--draft-len", type=int, default=4)
    add_workload_flags(p)
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    runs = run_all(models.target, scenarios(smallest(models.drafts), args.draft_len), args, edge)
    rows = []
    for r in runs:
        row = run_row(r, drafters_of(r) if "speculative" in r.scenario else None)
        row["steps_per_token"] = steps_per_token(r)
        rows.append(row)
    meta = run_meta("backends", argv, edge, draft_len=args.draft_len)
    write_results(out, "backends", {"meta": meta, "rows": rows}, table(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
