"""``python -m bench sim-jetson``: 1,000 Jetson-class drafters against one H100 verifier, simulated
with published step costs for an 8 B target.

This machine cannot measure that fleet; the simulator, validated against this machine's real runs
(``python -m bench sim-validate``), can run it with the real policies once it is given the two
machines' step costs. Both come from published measurements, each derived below from the numbers
its source printed (nothing here is tuned to a result):

* **The verifier: an H100 SXM running Llama-3-8B-Instruct in BF16 with vLLM.** The roofline of
  :class:`bench.sim.costs.H100Cost` (NVIDIA's datasheet: 3.35 TB/s, 989 TFLOPS dense BF16) with the
  two efficiencies that Lambda's published vLLM 0.6.0 run on one H100 80 GB SXM shows
  (github.com/LambdaLabsML/vllm-benchmark, ``results/prompt_10/1xH100-80GB-SXM/
  Meta-Llama-3-8B-Instruct_tp1_len2048.json``, 2024-09-07, 10 concurrent requests): decode steps of
  about 7.2 ms at up to 10 rows (its inter-token gaps, 70-75 ms per chunk of 10 scheduler steps;
  median TPOT 7.56 ms), and 62 ms to first token for 10 prompts of 1,369 tokens in all, prefilled
  together. Bandwidth: the weights' 16.1 GB over (7.2 − 1) ms is 0.77 of the datasheet's (the same
  share a published A100 sweep of Llama-3.1-8B in vLLM reports at one request). Compute:
  2 × 8.03 G × 1,369 FLOPs over (62 − 1) ms is 0.36 of the peak.
* **The drafters: a Jetson running the target's 4-bit copy.** NVIDIA's TensorRT Edge-LLM 0.4.0
  performance page (nvidia.github.io/TensorRT-Edge-LLM, "Performance Benchmarks", Jetson AGX Thor):
  Llama-3.1-8B-Instruct in INT4 AWQ generates 50.8 tokens/s at batch 1 and 135.3 at batch 8, and
  prefills 383 tokens in 215.5 ms. As the simulator's draft model, a forward of r rows takes
  forward_s + r·row_s: 19.7 ms at one row and 59.1 ms at eight give row_s = 5.6 ms and forward_s =
  14.1 ms; a prompt token costs 0.56 ms.

What it does not know is the 4-bit copy's acceptance against the BF16 8 B target: ``--alphas``
sweeps it, by default over what this family measured (the requantized Q4_0 copy's 0.76 and the
shipped Q4_1's 0.97, ``models/gguf`` cards) and between. Every point is one drafter per user (a
Jetson serves its own session, closed loop), ``--rtt-ms`` to the verifier, and its speed-up is over
the same sessions served target-only by the same H100 (which pays the round trip once per
request). Writes ``<out>/sim-jetson-h100.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.fleets import write_results
from bench.sim.costs import CostSpec, GpuSpec, TransformerShape
from bench.sim.engine import simulate
from bench.sim.spec import DrafterSpec, Policies, SimSpec, VerifierSpec, number_list

LAMBDA_H100 = "github.com/LambdaLabsML/vllm-benchmark results/prompt_10/1xH100-80GB-SXM/" \
              "Meta-Llama-3-8B-Instruct_tp1_len2048.json (vLLM 0.6.0, 2024-09-07)"
TRT_EDGE_THOR = "nvidia.github.io/TensorRT-Edge-LLM Performance Benchmarks (TensorRT Edge-LLM 0.4.0, Jetson " \
                "AGX Thor, Llama-3.1-8B-Instruct INT4 AWQ)"
H100_DECODE_STEP_S = 7.2e-3  # Lambda: inter-token gaps of 70-75 ms per 10-step chunk, up to 10 rows
H100_PREFILL_S, H100_PREFILL_TOKENS = 62e-3, 1369  # Lambda: TTFT of 10 prompts prefilled together
H100_LAUNCH_S = 1e-3  # the roofline's fixed cost per step (GpuSpec's default)
JETSON_TOK_S_B1, JETSON_TOK_S_B8 = 50.8, 135.3  # TRT Edge-LLM: generation tokens/s at batch 1 and 8
JETSON_PREFILL_S, JETSON_PREFILL_TOKENS = 215.5e-3, 383  # TRT Edge-LLM: prefill time of its prompt
#: the acceptance of a 4-bit copy measured on this family (models/gguf cards): Q4_0 requantized,
#: and the shipped Q4_1 (whose weights the target was dequantized from: an upper bound)
FAMILY_ALPHAS = (0.76, 0.9, 0.97)
MODES = ("target-only", "fixed k=2", "fixed k=4", "smartspec")


def published_gpu(model: TransformerShape | None = None) -> GpuSpec:
    """The H100's roofline with the bandwidth and compute shares Lambda's published run shows."""
    m = model or TransformerShape()
    base = GpuSpec()
    hbm = m.weight_bytes / (base.hbm_bytes_per_s * (H100_DECODE_STEP_S - H100_LAUNCH_S))
    flops = 2.0 * m.params * H100_PREFILL_TOKENS / (base.peak_flops * (H100_PREFILL_S - H100_LAUNCH_S))
    return replace(base, hbm_efficiency=hbm, flops_efficiency=flops, launch_s=H100_LAUNCH_S)


def jetson_costs() -> tuple[float, float, float]:
    """(forward_s, row_s, prefill_token_s) of the Jetson's 4-bit 8 B copy, from the published rates."""
    one, eight = 1.0 / JETSON_TOK_S_B1, 8.0 / JETSON_TOK_S_B8
    row = (eight - one) / 7.0
    return one - row, row, JETSON_PREFILL_S / JETSON_PREFILL_TOKENS


@dataclass(frozen=True)
class Point:
    drafters: int
    alpha: float
    rtt_ms: float
    mode: str


def policies_of(mode: str) -> Policies:
    """Fixed-S at k, or SmartSpec (with the coordinator's ``--speculation auto``: a request gets a
    drafter only while the allocator gives speculation a budget, else it is served target-only)."""
    if mode == "smartspec":
        return Policies(allocation="smartspec", draft_len=4, smartspec_max_len=8)
    k = int(mode.split("=")[1]) if "=" in mode else 4
    return Policies(draft_len=k, max_draft_tokens=max(16, k))


def spec_of(p: Point, prompt_len: int, max_tokens: int, duration_s: float) -> SimSpec:
    """``p.drafters`` Jetsons of one closed-loop session each against the published H100, for
    ``duration_s`` simulated seconds (every mode the same time, so rates compare)."""
    forward_s, row_s, prefill_s = jetson_costs()
    d = DrafterSpec("d", alpha=p.alpha, token_s=row_s, forward_s=forward_s, round_s=0.0, prefill_token_s=prefill_s,
                    rtt_s=p.rtt_ms / 1e3, pipeline_sessions=2, prompt_len=prompt_len, max_tokens=max_tokens)
    return SimSpec(tuple(replace(d, name=f"d{i}") for i in range(p.drafters)), policies_of(p.mode), VerifierSpec(),
                   CostSpec("h100", gpu=published_gpu()), speculative=p.mode != "target-only",
                   auto=p.mode == "smartspec", rounds=None, duration_s=duration_s)


def run(p: Point, args: argparse.Namespace) -> dict[str, Any]:
    """``p`` with each seed: the median goodput, and the mean TPOT and latency over the seeds."""
    sims = [simulate(replace(spec_of(p, args.prompt_len, args.max_tokens, args.duration_s), seed=seed))
            for seed in range(args.seeds)]
    tpots = [r.tpot_s for r in sims if r.tpot_s is not None]
    latencies = [r.latency_s for r in sims if r.latency_s is not None]
    return {"drafters": p.drafters, "alpha": p.alpha, "rtt_ms": p.rtt_ms, "mode": p.mode,
            "goodput_tok_s": statistics.median(r.goodput_tok_s for r in sims),
            "tpot_ms": statistics.fmean(tpots) * 1e3 if tpots else None,
            "latency_s": statistics.fmean(latencies) if latencies else None,
            "mean_step_ms": statistics.fmean((r.mean_step_s or 0.0) * 1e3 for r in sims),
            "mean_batch": statistics.fmean(r.mean_batch or 0.0 for r in sims),
            "acceptance": statistics.fmean(r.acceptance_rate or 0.0 for r in sims) if p.mode != "target-only" else None,
            "drafted_share": statistics.fmean(r.drafted_share or 0.0 for r in sims)}


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's goodput over its target-only row's (same fleet size, α and RTT)."""
    base = {(r["drafters"], r["alpha"], r["rtt_ms"]): r["goodput_tok_s"] for r in rows if r["mode"] == "target-only"}
    out = []
    for r in rows:
        b = base.get((r["drafters"], r["alpha"], r["rtt_ms"]))
        out.append({**r, "speedup": r["goodput_tok_s"] / b if b else None})
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    gpu, (forward_s, row_s, prefill_s) = meta["gpu"], meta["jetson"]
    lines = [
        "# Jetson-class drafters against one H100 verifier (simulated, published step costs)", "",
        f"Command: `{meta['command']}` ({meta['when']}).", "",
        f"Verifier: Llama-3-8B in BF16 on an H100 SXM, the datasheet's roofline at {gpu['hbm_efficiency']:.2f} of its "
        f"bandwidth and {gpu['flops_efficiency']:.2f} of its BF16 peak, {gpu['launch_s'] * 1e3:.0f} ms a step beyond "
        f"(from {LAMBDA_H100}).", "",
        f"Drafters: Llama-3.1-8B's INT4 copy on a Jetson AGX Thor, {forward_s * 1e3:.1f} ms a forward plus "
        f"{row_s * 1e3:.1f} ms a session in it, {prefill_s * 1e3:.2f} ms a prompt token (from {TRT_EDGE_THOR}); one "
        "user per Jetson, pipelined drafting.", "",
        f"Workload: {meta['prompt_len']}-token prompts, {meta['max_tokens']} output tokens, closed loop; "
        f"{meta['seeds']} seed(s) a point. α: the 4-bit copy's per-token acceptance (not published for this pair; "
        "0.76 and 0.97 are this family's Q4_0 and Q4_1 copies).", "",
        "| drafters | α | RTT ms | mode | tok/s | speed-up | TPOT ms | latency s | step ms | sessions/step "
        "| acceptance |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v: float | None, fmt: str) -> str:
        return "–" if v is None else format(v, fmt)
    for r in rows:
        lines.append(f"| {r['drafters']} | {r['alpha']:.2f} | {r['rtt_ms']:g} | {r['mode']} | {r['goodput_tok_s']:.0f} "
                     f"| {f(r['speedup'], '.2f')}× | {f(r['tpot_ms'], '.1f')} | {f(r['latency_s'], '.2f')} "
                     f"| {r['mean_step_ms']:.1f} | {r['mean_batch']:.0f} | {f(r['acceptance'], '.2f')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim-jetson", description=__doc__.splitlines()[0])
    p.add_argument("--drafters", type=lambda t: number_list(t, int, 1), default=[1, 100, 1000],
                   help="fleet sizes, comma-separated (one user per drafter)")
    p.add_argument("--alphas", type=lambda t: number_list(t, float, 0.0), default=list(FAMILY_ALPHAS),
                   help="the 4-bit copy's per-token acceptance, comma-separated")
    p.add_argument("--rtt-ms", type=lambda t: number_list(t, float, 0.0), default=[20.0],
                   help="each drafter's round trip to the verifier, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--duration-s", type=float, default=20.0, help="simulated seconds of every point")
    p.add_argument("--seeds", type=int, default=2, help="simulations a point, seeds 0, 1, ...")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if "target-only" not in modes:
        modes.insert(0, "target-only")  # every speed-up needs its baseline
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    baselines: dict[tuple[int, float], dict[str, Any]] = {}
    for n in args.drafters:
        for alpha in args.alphas:
            for rtt in args.rtt_ms:
                for mode in modes:
                    if mode == "target-only":  # no drafts, so no α: simulated once per fleet and RTT
                        key = (n, rtt)
                        baselines[key] = baselines.get(key) or run(Point(n, alpha, rtt, mode), args)
                        r = {**baselines[key], "alpha": alpha}
                    else:
                        r = run(Point(n, alpha, rtt, mode), args)
                    rows.append(r)
                    print(f"N={n} α={alpha:g} rtt={rtt:g} ms {mode}: {r['goodput_tok_s']:.0f} tok/s", flush=True)
    rows = with_speedups(rows)
    meta = {"command": "python -m bench sim-jetson " + " ".join(argv or []), "when": time.strftime("%Y-%m-%d %H:%M"),
            "gpu": vars(published_gpu()), "jetson": jetson_costs(), "sources": [LAMBDA_H100, TRT_EDGE_THOR],
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "seeds": args.seeds,
            "wall_s": time.perf_counter() - started}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, "sim-jetson-h100", {"meta": meta, "rows": rows}, markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
