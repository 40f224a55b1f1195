"""How faithful each forward is to the target in float32, and what each costs: the data behind dtype auto.

    python -m bench fidelity [--model DIR] [--prompts 8] [--tokens 64] [--questions 17]

The reference is transformers' own forward in float32. Its greedy answers to held-out chat
prompts are then scored teacher-forced by every forward below, counting the positions where the
forward's top-1 token is the reference's (the issue's measure); and short held-out questions, with
the README's first request first, are answered free-running, counting answers equal to the
reference's. The forwards:

* transformers in bfloat16 (what a user of transformers gets);
* specfleet's runner over bfloat16 weights with bfloat16 activations (before float32 activations);
* specfleet's runner over bfloat16 weights with float32 activations (the default on a CPU:
  ``shared.runner.runner.activation_dtype``), plain and batch-invariant;
* specfleet's runner in float32, plain and batch-invariant.

Each forward's decode step (1 token at 128 cached, one thread) is timed in the same run. The
CPU's flags head the report: bfloat16 emulated on an AVX2 CPU has the same numerics, slower.
Writes ``bench/results/fidelity.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.model_import import DEFAULT_MODEL, fetch_model
from shared.models import LoadedModel, load_model
from shared.runner import ModelRunner, Segment
from shared.runner.runner import greedy_decode, kv_shape
from training.evaluate_gguf import cpu_flag_summary
from training.teacher import chat_ids

OUT = Path("bench/results")
README_QUESTION = "What is the capital of France?"
STEP_CONTEXT = 128


@dataclass
class Forward:
    name: str
    #: logits [len(ids) - start, V] of ids[:-1]'s positions from ``start``
    score: Callable[[list[int], int], torch.Tensor]
    step_ms: Callable[[], float]
    #: greedy decoding with the forward's own cache: (prompt, tokens, eos ids) -> new tokens
    greedy: Callable[[list[int], int, set[int]], list[int]]


def _runner_forward(name: str, loaded: LoadedModel, invariant: bool, activations: torch.dtype | None) -> Forward:
    runner = ModelRunner(loaded, 4096 * 4 * kv_shape(loaded.model).bytes_per_token, "lean",
                         batch_invariant=invariant, activations=activations)

    def score(ids: list[int], start: int) -> torch.Tensor:
        slot = runner.kv.allocate(len(ids))
        assert slot is not None
        try:
            out = runner.forward([Segment(slot, ids, start)])
            assert out is not None
            return out
        finally:
            runner.kv.free(slot)

    def step_ms() -> float:
        slot = runner.kv.allocate(STEP_CONTEXT + 1)
        assert slot is not None
        try:
            runner.forward([Segment(slot, [(7 * j) % 1000 + 10 for j in range(STEP_CONTEXT)], STEP_CONTEXT)])
            began = time.perf_counter()
            runner.forward([Segment(slot, [11], 0)])
            return (time.perf_counter() - began) * 1e3
        finally:
            runner.kv.free(slot)

    return Forward(name, score, step_ms, lambda prompt, tokens, eos: greedy_decode(runner, prompt, tokens, eos))


def _hf_forward(name: str, loaded: LoadedModel) -> Forward:
    model = loaded.model

    def score(ids: list[int], start: int) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, start:].float()

    def step_ms() -> float:
        out = model(input_ids=torch.tensor([[(7 * j) % 1000 + 10 for j in range(STEP_CONTEXT)]]), use_cache=True)
        began = time.perf_counter()
        model(input_ids=torch.tensor([[11]]), past_key_values=out.past_key_values, use_cache=True)
        return (time.perf_counter() - began) * 1e3

    def greedy(prompt: list[int], tokens: int, eos: set[int]) -> list[int]:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, eos_token_id=sorted(eos),
                             pad_token_id=sorted(eos)[0])
        return [int(t) for t in out[0, len(prompt):]]

    return Forward(name, score, step_ms, greedy)


def _chat(loaded: LoadedModel, text: str) -> list[int]:
    return chat_ids(loaded.tokenizer, text)


@torch.inference_mode()
def measure(model_dir: Path, prompts: int, tokens: int, questions: int) -> dict[str, Any]:
    from bench.edge_drafts import heldout_prompts

    reference, bf16 = load_model(model_dir, dtype="float32"), load_model(model_dir, dtype="bfloat16")
    ref = _hf_forward("transformers float32 (reference)", reference)
    forwards = [
        _hf_forward("transformers bfloat16", bf16),
        _runner_forward("specfleet bfloat16, bfloat16 activations", bf16, False, torch.bfloat16),
        _runner_forward("specfleet bfloat16, bfloat16 activations, batch-invariant", bf16, True, torch.bfloat16),
        _runner_forward("specfleet bfloat16 (float32 activations)", bf16, False, None),
        _runner_forward("specfleet bfloat16 (float32 activations), batch-invariant", bf16, True, None),
        _runner_forward("specfleet float32", reference, False, None),
        _runner_forward("specfleet float32, batch-invariant", reference, True, None),
    ]
    eos = reference.eos_ids
    chats = [_chat(reference, p) for p in heldout_prompts(prompts)]
    answers = [ref.greedy(c, tokens, eos) for c in tqdm(chats, desc="reference answers", unit="prompt")]
    asked = [README_QUESTION, *heldout_prompts(prompts + questions)[prompts:]][:questions]
    ref_replies = [ref.greedy(_chat(reference, q), 40, eos) for q in tqdm(asked, desc="reference replies")]
    rows = []
    for fw in tqdm(forwards, desc="forwards", unit="forward"):
        agree = sum(int((fw.score(c + a[:-1], len(c) - 1).argmax(-1) == torch.tensor(a)).sum())
                    for c, a in zip(chats, answers, strict=True))
        replies = [fw.greedy(_chat(reference, q), 40, eos) for q in asked]
        rows.append({"forward": fw.name, "agree": agree, "positions": sum(len(a) for a in answers),
                     "same_replies": sum(r == w for r, w in zip(replies, ref_replies, strict=True)),
                     "questions": len(asked), "readme_reply": reference.tokenizer.decode(replies[0]),
                     "step_ms": statistics.median(fw.step_ms() for _ in range(15))})
    return {"model": str(model_dir), "cpu": cpu_flag_summary(), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "reference_readme_reply": reference.tokenizer.decode(
                ref_replies[0]), "rows": rows}


def write(report: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fidelity.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Fidelity to float32, and each forward's step ({report['date']})", "",
             f"CPU: {report['cpu']}; {report['threads']} torch thread(s); model `{report['model']}`. "
             "Top-1: teacher-forced on transformers float32's greedy answers. Replies: free-running, 40 tokens, "
             "equal to float32's. Step: 1 token at 128 cached, median of 15.", "",
             f"float32's reply to {README_QUESTION!r}: {report['reference_readme_reply']!r}", "",
             "| forward | top-1 = float32 | replies = float32 | reply to the README's question | step |",
             "|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['forward']} | {r['agree']} / {r['positions']} | {r['same_replies']} / {r['questions']} "
                     f"| {r['readme_reply'][:60]!r} | {r['step_ms']:.1f} ms |")
    (OUT / "fidelity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench fidelity", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="target model directory (default: the fetched default model)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out chat prompts scored teacher-forced")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of each reference answer")
    parser.add_argument("--questions", type=int, default=17, help="questions answered free-running (40 tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the verifier's core)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else fetch_model(DEFAULT_MODEL, Path(".specfleet"))
    write(measure(model_dir, args.prompts, args.tokens, args.questions))
    return 0
