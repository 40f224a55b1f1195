"""One stream, every way of serving it (``python -m bench single``): issue 10's first scenario.

Side by side in one run, on the same target/draft pair and the same prompts, one request at a
time (the edge emulated by pinning, and at each RTT of ``--rtts`` by the edge network):

* target-only serving;
* specfleet with 1 drafter under each drafting policy: fixed k, threshold, AdaSpec, n-gram
  (WISP needs a trained predictor: ``python -m bench policies`` trains and measures it);
* Hugging Face assisted generation (``generate(assistant_model=draft)``, greedy), and its own
  ``generate`` alone, both in one process on the server CPU (``bench.costs --assistant``).

Each specfleet row also shows the analytic bound on its speedup, the expected tokens per
target step over the cost of a round, (1 − α^(k+1)) / ((1 − α)(k·c + 1)), from the per-token
acceptance α measured in that row (solved from accepted / drafted at budget k) and the cost
ratio c = draft step / target step measured in this run. The bound counts no network, no
serving overhead and a free verification of k + 1 tokens, so it is an upper bound; on a CPU,
verifying k + 1 tokens costs more than one (``t_verify(k+1)`` in the row), and the row also gives
the bound with that cost. The formula is fixed k's: for controllers that stop early, α is
solved as if every round drafted k tokens, so their bound is optimistic. n-gram lookup
drafts almost for free, so its true bound is above the printed one. Writes
``<out>/single.{json,md}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.edge import Edge, run_pinned
from bench.fleets import PROMPTS, Run, Scenario, add_workload_flags, prepare, run_meta, write_results
from bench.peers import HF_ASSISTANT
from bench.policies import POLICIES
from bench.profile import smallest
from bench.serving import run_all
from shared.gguf_files import gguf_file

SINGLE_POLICIES = {name: flags for name, flags in POLICIES.items() if name != "wisp"}


def per_token_alpha(acceptance: float, k: int) -> float:
    """α such that (α + α² + … + α^k) / k = acceptance (greedy rounds stop at the first rejection)."""
    if acceptance <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) / k < acceptance:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def speedup_bound(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected tokens per round over the round's cost in target steps: k draft steps at c each
    plus one verification of k + 1 tokens costing ``verify_cost`` target steps."""
    tokens = float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + verify_cost)


def assistant_for(draft: Path) -> Path:
    """transformers' assistant beside ``draft``: the draft itself, or for a GGUF copy (which
    transformers cannot run) the distilled small draft, as ``bench real``'s hf-assisted peer."""
    return HF_ASSISTANT if gguf_file(draft) is not None else draft


def measure_costs(target: Path, draft: Path, k: int, tokens: int, edge: Edge) -> dict[str, Any]:
    """The target's 1- and (k+1)-token forwards and HF generate (server CPU), and the draft's step
    (edge CPU): a model directory's 1-token forward at 128 cached, or a GGUF copy's batch-1 decode
    step in llama.cpp after a held-out chat prompt."""
    prompts = [arg for p in PROMPTS[:4] for arg in ("--prompt-text", p)]
    assistant = assistant_for(draft)
    server = run_pinned("bench.costs", edge.server_cpus, ["--model", str(target), "--decode", str(tokens),
                                                          "--shapes", f"1x128x1,1x128x{k + 1}", "--assistant",
                                                          str(assistant), *prompts])
    if assistant != draft:  # a GGUF copy: its step on llama.cpp
        drafting = run_pinned("bench.edge_drafts", edge.edge_cpus, ["--gguf-step", str(draft), "--prompt-from",
                                                                    str(target)])
        draft_ms = drafting["step_ms"]
    else:
        drafting = run_pinned("bench.costs", edge.edge_cpus, ["--model", str(draft), "--shapes", "1x128x1"])
        draft_ms = drafting["forward_ms"]["1x128x1"]
    t1, tk = server["forward_ms"]["1x128x1"], server["forward_ms"][f"1x128x{k + 1}"]
    return {"target": server, "draft": drafting, "c": draft_ms / t1, "verify_cost": tk / t1,
            "assistant": str(assistant)}


def scenarios(draft: Path, k: int, rtts: list[float]) -> list[Scenario]:
    out = [Scenario("target-only", rtt_ms=0.0)]
    for rtt in rtts:
        out += [Scenario(f"rtt {rtt:g} ms, {name}", drafters=1, draft=str(draft), draft_len=k, drafter_flags=flags,
                         rtt_ms=rtt) for name, flags in SINGLE_POLICIES.items()]
    return out


def rows_of(runs: list[Run], costs: dict[str, Any], k: int) -> list[dict[str, Any]]:
    base = next(r.tokens_per_s for r in runs if r.scenario == "target-only")
    rows = []
    for r in runs:
        row: dict[str, Any] = {"scenario": r.scenario, "tokens_per_s": r.tokens_per_s, "runs": r.rates,
                               "speedup": r.tokens_per_s / base, "acceptance": r.acceptance, "network": r.network}
        if r.scenario != "target-only":
            alpha = per_token_alpha(r.acceptance, k)
            row |= {"alpha": alpha, "bound": speedup_bound(alpha, k, costs["c"]),
                    "bound_cpu_verify": speedup_bound(alpha, k, costs["c"], costs["verify_cost"])}
        rows.append(row)
    hf = costs["target"]
    assistant = Path(costs["assistant"]).name
    rows.append({"scenario": f"HF assisted generation (assistant {assistant}, server CPU)",
                 "tokens_per_s": hf["hf_assisted_tok_s"],
                 "speedup": hf["hf_assisted_tok_s"] / hf["hf_generate_tok_s"], "network": "one process",
                 "vs": "HF generate alone"})
    return rows


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; k = {meta['k']}; "
             f"c = {meta['c']:.3f}; t_verify(k+1) / t_target(1) = {meta['verify_cost']:.2f}).", "",
             "| scenario | tokens/s (median) | speedup | acceptance | α | bound | bound with CPU verify cost |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f"{r['acceptance']:.3f} | {r['alpha']:.3f} | {r['bound']:.2f}x | {r['bound_cpu_verify']:.2f}x"
                 if "alpha" in r else " | | | ")
        vs = f" (vs {r['vs']})" if "vs" in r else ""
        lines.append(f"| {r['scenario']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x{vs} | {extra} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench single", description=__doc__.splitlines()[0])
    p.add_argument("--rtts", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 10.0, 40.0])
    p.add_argument("--draft-len", type=int, default=4)
    add_workload_flags(p, repeats=2, requests=8, max_tokens=64, concurrency=(1,))
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    draft = smallest(models.drafts)
    print(f"raw model costs and HF assisted generation ({edge.describe()}) ...", flush=True)
    costs = measure_costs(models.target, draft, args.draft_len, args.max_tokens, edge)
    runs = run_all(models.target, scenarios(draft, args.draft_len, args.rtts), args, edge)
    rows = rows_of(runs, costs, args.draft_len)
    meta = run_meta("single", argv, edge, k=args.draft_len, c=costs["c"], verify_cost=costs["verify_cost"])
    write_results(out, "single", {"meta": meta, "costs": costs, "rows": rows}, table(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
