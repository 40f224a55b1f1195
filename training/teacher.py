"""The teacher's answers: the target's own replies to the prompt grid, as token ids.

A plain batched decode loop on specfleet's own model runner: every live answer is one segment
of a packed step (no padding), and a finished answer's place goes to the next prompt at once,
its prompt prefilled in the same step. Answers are appended to a JSON-lines file as they finish
(``{"id", "mode", "answer": [ids]}``), so an interrupted run resumes where it stopped, and the
file is small enough to commit (the costly part to remake is the target's time, not the bytes).

Most prompts are answered greedily, as greedy serving sees them; every ``sample_every``-th is
sampled at ``temperature``, seeded by its id, so drafts also see the target's other likely
continuations.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.models import LoadedModel
from shared.runner import ModelRunner, Segment
from training.prompts import Prompt


@dataclass(frozen=True)
class TeacherPlan:
    max_new_tokens: int = 256
    batch: int = 48  # answers decoded at once
    sample_every: int = 3  # every 3rd prompt is sampled, the rest greedy (0: all greedy)
    temperature: float = 0.8
    token_budget: int = 220_000  # stop once this many answer tokens exist


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the serving path renders it: the chat template with its default system prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def read_answers(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a torn last line from an interrupted run: dropped, its prompt is redone
    return out


def mode_of(prompt: Prompt, index: int, plan: TeacherPlan) -> str:
    sampled = plan.sample_every > 0 and index % plan.sample_every == plan.sample_every - 1
    return f"t{plan.temperature:g}" if sampled else "greedy"


@dataclass
class _Live:
    prompt: Prompt
    mode: str
    ids: list[int]
    slot: Any
    answer: list[int]
    generator: torch.Generator | None
    fed: bool = False  # the prompt has been prefilled


def generate_answers(loaded: LoadedModel, prompts: list[Prompt], out: Path, plan: TeacherPlan,
                     kv_budget_bytes: int = 1 << 30) -> dict[str, Any]:
    """Answer ``prompts`` in order until ``plan.token_budget`` answer tokens exist in ``out``."""
    done = read_answers(out)
    if done:  # rewrite without any torn line before appending
        out.write_text("".join(json.dumps(r) + "\n" for r in done))
    have = {r["id"] for r in done}
    tokens = sum(len(r["answer"]) for r in done)
    todo = ((i, p) for i, p in enumerate(prompts) if p.id not in have)
    runner = ModelRunner(loaded, kv_budget_bytes, kind="auto")
    eos = loaded.eos_ids
    bar = tqdm(total=plan.token_budget, initial=min(tokens, plan.token_budget), desc="teacher answers",
               unit="tok", dynamic_ncols=True)
    started, live = time.monotonic(), list[_Live]()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        while True:
            live += _admit(runner, loaded, todo, plan, live, tokens)
            if not live:
                break
            finished = _step(runner, live, plan, eos)
            for item in finished:
                record = {"id": item.prompt.id, "mode": item.mode, "answer": item.answer}
                sink.write(json.dumps(record) + "\n")
                tokens += len(item.answer)
                bar.update(len(item.answer))
                runner.kv.free(item.slot)
            sink.flush()
            live = [x for x in live if x not in finished]
    bar.close()
    return {"answers": len(read_answers(out)), "tokens": tokens, "seconds": round(time.monotonic() - started, 1)}


def _admit(runner: ModelRunner, loaded: LoadedModel, todo: Iterator[tuple[int, Prompt]], plan: TeacherPlan,
           live: list[_Live], tokens: int) -> list[_Live]:
    new: list[_Live] = []
    while len(live) + len(new) < plan.batch and tokens < plan.token_budget:
        nxt = next(todo, None)
        if nxt is None:
            break
        index, prompt = nxt
        ids = chat_ids(loaded.tokenizer, prompt.text)
        slot = runner.kv.allocate(len(ids) + plan.max_new_tokens)
        if slot is None:
            raise RuntimeError("the teacher's KV budget is too small for its batch; lower the batch")
        mode = mode_of(prompt, index, plan)
        gen = None
        if mode != "greedy":
            seed = int.from_bytes(hashlib.sha256(prompt.id.encode()).digest()[:8], "big")
            gen = torch.Generator().manual_seed(seed)
        new.append(_Live(prompt, mode, ids, slot, [], gen))
    return new


def _step(runner: ModelRunner, live: list[_Live], plan: TeacherPlan, eos: set[int]) -> list[_Live]:
    """One packed forward: prefill new prompts, decode the rest; returns the answers that ended."""
    segments = []
    for item in live:
        if not item.fed:
            segments.append(Segment(item.slot, item.ids, len(item.ids) - 1))
            item.fed = True
        else:
            segments.append(Segment(item.slot, item.answer[-1:], 0))
    logits = runner.forward(segments)
    assert logits is not None
    finished = []
    for item, row in zip(live, logits, strict=True):
        if item.generator is None:
            token = int(row.argmax())
        else:
            probs = torch.softmax(row / plan.temperature, -1)
            token = int(torch.multinomial(probs, 1, generator=item.generator))
        item.answer.append(token)
        if token in eos or len(item.answer) >= plan.max_new_tokens:
            finished.append(item)
    return finished

