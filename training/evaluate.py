"""Measure the exported drafts against the target; write MEASUREMENTS.json and the model cards.

Models are loaded the way the services load them (``shared.models.load_model``, dtype ``auto``),
so the numbers describe what is committed under ``models/``. On the held-out prompts' greedy
answers of the target (prompts never trained on):

- greedy agreement: how often the draft's argmax is the target's next token, teacher-forced;
- Σ min(p, q) at T = 1: the probability that lossless speculative sampling accepts one drafted
  token, averaged over the same positions;
- mean accepted per round at k = 4: an exact replay of greedy speculative rounds;
- step cost: one decode step at batch 1 (context of a held-out prompt) through specfleet's
  model runner, on one thread, median of interleaved runs, as a fraction of the target's.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.models import LoadedModel, load_model
from shared.runner import ModelRunner, Segment
from shared.runner.runner import kv_shape
from shared.runner.step import SegmentRunner
from training.teacher_logits import Sequence

ROUND_K = 4
COST_STEPS, COST_RUNS = 32, 9


def greedy_round_lengths(matches: list[bool], k: int) -> list[int]:
    """Accepted drafted tokens in each round of greedy speculative decoding with k drafts.

    matches[i] says whether the draft's argmax equals the target's token i, with both fed the
    target's greedy sequence before i. While the draft agrees its own proposals *are* that
    sequence, so a round starting at s accepts the run of matches from s (capped at k), the
    target then emits one token (its correction or the bonus), and the next round starts after it.
    """
    lengths, s = [], 0
    while s < len(matches):
        accepted = 0
        while accepted < k and s + accepted < len(matches) and matches[s + accepted]:
            accepted += 1
        lengths.append(accepted)
        s += accepted + 1
    return lengths


@torch.inference_mode()
def answer_logits(model: Any, seq: Sequence) -> torch.Tensor:
    """Logits ``[len(answer), V]`` (float32) at the positions predicting each answer token."""
    ids = torch.tensor([seq.ids[:-1]])
    first = len(seq.prompt) - 1
    return model(input_ids=ids, use_cache=False).logits[0, first:].float()


@torch.inference_mode()
def pair_stats(target: Any, draft: Any, held: list[Sequence]) -> dict[str, float]:
    """Greedy agreement, Σ min(p, q) at T = 1 and greedy rounds of ``draft`` against ``target``."""
    agree = accept = 0.0
    count, lengths = 0, []
    for seq in tqdm(held, desc="agreement", leave=False):
        p = torch.softmax(answer_logits(target, seq), -1)
        q = torch.softmax(answer_logits(draft, seq), -1)
        answer = torch.tensor(seq.answer)
        matches = q.argmax(-1) == answer
        agree += float(matches.sum())
        accept += float(torch.minimum(p, q).sum())
        count += len(seq.answer)
        lengths += greedy_round_lengths(matches.tolist(), ROUND_K)
    return {"greedy_agreement": round(agree / count, 4), "accept_t1": round(accept / count, 4),
            "mean_accepted_k4": round(sum(lengths) / len(lengths), 3), "positions": count}


@torch.inference_mode()
def step_costs(models: dict[str, LoadedModel], prompt: list[int]) -> dict[str, float]:
    """Median ms of one batch-1 decode step of each model after ``prompt``, runs interleaved."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {name: [] for name in models}
    try:
        runners = {n: ModelRunner(lm, (len(prompt) + COST_STEPS + 8) * 2 * kv_shape(lm.model).bytes_per_token,
                                  "auto", self_check=False) for n, lm in models.items()}
        for _ in range(COST_RUNS):
            for name, runner in runners.items():
                samples[name].append(decode_ms(runner, prompt))
        return {name: round(statistics.median(v), 3) for name, v in samples.items()}
    finally:
        torch.set_num_threads(before)


def decode_ms(runner: SegmentRunner, prompt: list[int]) -> float:
    """Milliseconds of one batch-1 decode step after ``prompt``, over COST_STEPS greedy steps."""
    slot = runner.kv.allocate(len(prompt) + COST_STEPS + 1)
    assert slot is not None
    try:
        logits = runner.forward([Segment(slot, prompt, len(prompt) - 1)])
        assert logits is not None
        token, t0 = int(logits[-1].argmax()), time.perf_counter()
        for _ in range(COST_STEPS):
            logits = runner.forward([Segment(slot, [token], 0)])
            assert logits is not None
            token = int(logits[-1].argmax())
        return (time.perf_counter() - t0) * 1000 / COST_STEPS
    finally:
        runner.kv.free(slot)


def evaluate_drafts(target_dir: Path, draft_dirs: list[Path], held: list[Sequence]) -> dict[str, Any]:
    """Every measurement of every draft; the caller writes it down."""
    started = time.monotonic()
    target = load_model(target_dir)
    drafts = {p.name: load_model(p) for p in draft_dirs}
    wrong = [n for n, d in drafts.items() if d.fingerprint != target.fingerprint]
    if wrong:
        raise ValueError(f"{wrong} do not share the target's tokenizer; retrain them with `make demo-models`")
    costs = step_costs({"target": target, **drafts}, held[0].prompt)
    models: dict[str, Any] = {}
    for name, lm in drafts.items():
        path = next(p for p in draft_dirs if p.name == name)
        models[name] = {
            **pair_stats(target.model, lm.model, held),
            "step_ms": costs[name], "step_ratio": round(costs[name] / costs["target"], 4),
            "parameters": sum(p.numel() for p in {id(p): p for p in lm.model.parameters()}.values()),
            "weight_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
        }
    return {
        "target": {"name": target.name, "dtype": str(next(target.model.parameters()).dtype).removeprefix("torch."),
                   "step_ms": costs["target"]},
        "heldout": {"prompts": len(held), "positions": sum(len(s.answer) for s in held)},
        "machine": platform.processor() or platform.machine(),
        "method": {
            "greedy_agreement": "teacher-forced on the target's greedy answers to held-out prompts",
            "accept_t1": "mean over the same positions of sum_x min(p(x), q(x)) at temperature 1",
            "mean_accepted_k4": f"exact greedy speculative rounds with k={ROUND_K} on those answers",
            "step": f"one batch-1 decode step through specfleet's model runner, 1 thread, dtype auto, median of "
                    f"{COST_RUNS} interleaved runs of {COST_STEPS} steps",
        },
        "models": models,
        "eval_seconds": round(time.monotonic() - started, 1),
    }


def write_measurements(report: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "MEASUREMENTS.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
