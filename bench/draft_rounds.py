"""Drafting alone, round by round, on the target's answers: ``python -m bench draft-rounds``.

What a drafter's time per committed token is without the fleet's noise (the verifier's core, the
network, the other services): a child pinned to the edge CPU runs the target's GGUF copy on the
drafter's default backend (specfleet's 4-bit kernel, one thread) and drafts, teacher-forced, for each
held-out chat prompt: a draft of ``--k`` tokens, then a commit of its prefix that matches the target's
greedy answer and the target's own next token, as the verifier commits, until ``--max-tokens`` of the
answer are committed. Each configuration drafts every answer in turn, interleaved, after a warm-up pass;
prefills are not timed. Configurations: ``none`` (no looked-up rows), ``lookup`` (``--lookup-rows 3``),
``table`` (and the next-token table, ``shared/next_tokens.py``). Also counts, with no model, how often
prompt lookup and the table guess the answer's next token. Writes ``<out>/draft-rounds.{json,md}``.

    python -m bench draft-rounds [--prompts 24] [--k 5] [--max-tokens 128] [--width Q4_1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.edge import add_edge_flags, edge_from, run_pinned
from bench.fleets import run_meta, write_results
from shared.gguf_copies import copy_path, table_path
from shared.up import resolve_models
from training.evaluate_gguf import cpu_flag_summary

CONFIGS = ("none", "lookup", "table")


def held_out(target: Path, prompts: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids as serving renders them, the target's greedy answer cut to ``max_tokens``) per prompt."""
    from training.config import Settings
    from training.pipeline import prepare

    _, _, held = prepare(Settings(target=str(target)))
    return [(list(s.prompt), list(s.answer[:max_tokens])) for s in held[:prompts]]


def guess_counts(answers: list[list[int]], table_file: Path) -> dict[str, float]:
    """Per answer position: how often prompt lookup guesses (and is right), and where it has nothing,
    how often the table guesses (and is right)."""
    from services.drafter.proposers.draft_model import LOOKUP_MAX_N, LOOKUP_MIN_N
    from services.drafter.proposers.ngram import lookup
    from shared.next_tokens import load_table

    table = load_table(table_file)
    positions = looked = looked_right = tabled = tabled_right = 0
    for answer in answers:
        for i in range(2, len(answer)):
            positions += 1
            guess = lookup(answer[:i], 1, LOOKUP_MAX_N, LOOKUP_MIN_N)
            if guess:
                looked, looked_right = looked + 1, looked_right + (guess[0] == answer[i])
            elif (t := table.guess(answer[:i])) is not None:
                tabled, tabled_right = tabled + 1, tabled_right + (t == answer[i])
    every = max(positions, 1)
    return {"positions": positions, "lookup_share": looked / every, "lookup_right": looked_right / max(looked, 1),
            "table_share": tabled / every, "table_right": tabled_right / max(tabled, 1),
            "table_tokens_a_position": tabled_right / every}


def draft_rounds(gguf: str, table_file: str, target: str, prompts: int, k: int, max_tokens: int) -> dict[str, Any]:
    """The pinned child: every configuration over every answer, interleaved; the second pass timed."""
    import torch

    from services.drafter.proposers.gguf import GgufProposer
    from shared.draft_q import Nucleus
    from shared.gguf_files import read_gguf
    from shared.next_tokens import load_table
    from shared.protocol import SamplingParams
    from shared.runner.gguf_backend import gguf_runner, kv_cache_dtype

    torch.set_num_threads(1)
    info, table = read_gguf(Path(gguf)), load_table(Path(table_file))
    sequences = held_out(Path(target), prompts, max_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens + k + 1)
    live: dict[str, dict[str, int]] = {}  # every forward each configuration's runner made, and its rows
    totals = {name: {"forwards": 0.0, "rows": 0.0, "seconds": 0.0, "committed": 0.0} for name in CONFIGS}
    proposers = {}
    for name in CONFIGS:
        runner = gguf_runner(info, 2**28, "specfleet", 1, 2, kv_cache_dtype("float16"))
        proposer = GgufProposer(runner, info, "sampled", Nucleus(), True, 0 if name == "none" else 3)
        proposer.next_tokens = table if name == "table" else None
        proposers[name] = proposer
        live[name] = {"forwards": 0, "rows": 0}

        def counting(segments: Any, forward: Any = runner.forward, c: dict[str, int] = live[name]) -> Any:
            c["forwards"] += 1
            c["rows"] += sum(len(s.tokens) for s in segments)
            return forward(segments)

        runner.forward = counting  # type: ignore[method-assign]
    for timed in (False, True):
        for i, (prompt, answer) in enumerate(sequences):
            for name, proposer in proposers.items():
                one_answer(proposer, f"{timed}-{i}", prompt, answer, k, greedy, live[name],
                           totals[name] if timed else None)
    rounds = {name: {"forwards_a_token": t["forwards"] / t["committed"],
                   "rows_a_forward": t["rows"] / t["forwards"], "ms_a_token": 1e3 * t["seconds"] / t["committed"],
                   "ms_a_forward": 1e3 * t["seconds"] / t["forwards"]} for name, t in totals.items()}
    return {"rounds": rounds, "guesses": guess_counts([answer for _, answer in sequences], Path(table_file))}


def one_answer(proposer: Any, sid: str, prompt: list[int], answer: list[int], k: int, params: Any,
               live: dict[str, int], totals: dict[str, float] | None) -> None:
    """Draft ``answer`` round by round; with ``totals``, add the rounds' drafting time, forwards, rows
    and committed tokens (the prompt's prefill left out)."""
    import torch

    from services.drafter.proposers.base import DraftJob, JobSession

    def job(n: int) -> DraftJob:
        return DraftJob(JobSession(sid, params, torch.Generator()), n)

    proposer.start(sid, prompt, len(answer) + k + 1)
    proposer.propose([job(1)])  # the prompt's prefill, left out
    proposer.commit(sid, [], 0)
    forwards, rows = live["forwards"], live["rows"]
    at, seconds = 0, 0.0
    while at < len(answer):
        started = time.perf_counter()
        draft = proposer.propose([job(k)])[0].token_ids
        seconds += time.perf_counter() - started
        accepted = next((j for j, t in enumerate(draft) if at + j >= len(answer) or t != answer[at + j]),
                        len(draft))
        new = answer[at : at + accepted + 1]  # the accepted drafts and the target's own token
        proposer.commit(sid, new, accepted)
        at += len(new)
    proposer.close(sid)
    if totals is not None:
        totals["seconds"] += seconds
        totals["committed"] += len(answer)
        totals["forwards"] += live["forwards"] - forwards
        totals["rows"] += live["rows"] - rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench draft-rounds", description=__doc__.splitlines()[0])
    p.add_argument("--width", default="Q4_1", help="which GGUF copy of the target (Q4_1 or Q8_0)")
    p.add_argument("--prompts", type=int, default=24, help="held-out chat prompts")
    p.add_argument("--k", type=int, default=5, help="draft tokens a round")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of each answer")
    p.add_argument("--target", default="")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a pinned child: its arguments as JSON
    add_edge_flags(p)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(draft_rounds(**json.loads(args.one))))
        return 0
    edge = edge_from(args)
    target = resolve_models(args.target, "", Path.cwd(), Path(".specfleet")).target
    one = {"gguf": str(copy_path(target, args.width)), "table_file": str(table_path(target)), "target": str(target),
           "prompts": args.prompts, "k": args.k, "max_tokens": args.max_tokens}
    # the child counts the guesses too: the held-out answers are read (and the target loaded) once
    child = run_pinned("bench.draft_rounds", edge.edge_cpus, ["--one", json.dumps(one)])
    results, guesses = child["rounds"], child["guesses"]
    meta = run_meta("draft-rounds", argv, edge, cpu=cpu_flag_summary(), width=args.width)
    write_results(Path(args.out), "draft-rounds", {"meta": meta, "results": results, "guesses": guesses},
                  report(meta, args, results, guesses))
    return 0


def report(meta: dict[str, Any], args: argparse.Namespace, results: dict[str, Any],
           guesses: dict[str, float]) -> list[str]:
    lines = [f"Command: `{meta['command']}` ({meta['when']}; {meta['edge']}; {meta['cpu']}; the {args.width} copy "
             f"on specfleet's 4-bit kernel, one thread, drafts of {args.k} teacher-forced on the target's greedy "
             f"answers to {args.prompts} held-out chat prompts, {args.max_tokens} tokens each).", "",
             "| looked-up rows | forwards per committed token | rows a forward | ms per committed token | "
             "ms a forward |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['forwards_a_token']:.3f} | {r['rows_a_forward']:.2f} | {r['ms_a_token']:.2f} | "
              f"{r['ms_a_forward']:.2f} |" for name, r in results.items()]
    g = guesses
    lines += ["", f"Over {g['positions']} answer positions (each answer's own text): prompt lookup guesses at "
              f"{g['lookup_share']:.2f} of them, "
              f"right at {g['lookup_right']:.2f} of those; where it has nothing the table guesses at "
              f"{g['table_share']:.2f} of all positions, right at {g['table_right']:.2f} of those "
              f"({g['table_tokens_a_position']:.3f} tokens a position)."]
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
