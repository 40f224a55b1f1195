"""The teacher's distributions: the target's top-k next-token log-probabilities over its answers.

Given the answers (token ids), one forward per batch of whole sequences (prompt + answer)
gives the target's distribution at every position that predicts an answer token: the last
prompt position and every answer position but the last. The top ``k`` log-probabilities (of the
full softmax at T = 1) and their ids are kept, in shards under the state directory, so an
interrupted pass resumes shard by shard. This is the costly part to recompute after a fresh
clone (a forward over given text, about 1,300 tokens/s in bfloat16 on two cores), and it is not
committed: the answers are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.models import LoadedModel
from shared.runner import ModelRunner, Segment
from shared.runner.runner import kv_shape


@dataclass(frozen=True)
class Sequence:
    """One training sequence: the rendered prompt's ids, then the teacher's answer."""

    id: str
    prompt: list[int]
    answer: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.answer


@dataclass
class TopK:
    """Per sequence: ``ids`` and ``logprobs`` ``[len(answer), k]`` predicting each answer token."""

    ids: torch.Tensor  # int32
    logprobs: torch.Tensor  # float16


def shard_path(state: Path, shard: list[Sequence], k: int) -> Path:
    """Named by what it holds, so a grown or changed answer list never reuses a stale shard."""
    digest = hashlib.sha256(json.dumps([k, [[s.id, len(s.ids)] for s in shard]]).encode()).hexdigest()[:16]
    return state / f"topk-{digest}.pt"


def teacher_topk(loaded: LoadedModel, sequences: list[Sequence], state: Path, k: int = 32,
                 tokens_per_step: int = 2048, shard_size: int = 200) -> dict[str, TopK]:
    """Top-k teacher distributions for every sequence (cached in ``state``, resumable)."""
    state.mkdir(parents=True, exist_ok=True)
    shards = [sequences[i : i + shard_size] for i in range(0, len(sequences), shard_size)]
    total = sum(len(s.answer) for s in sequences)
    out: dict[str, TopK] = {}
    runner: ModelRunner | None = None
    bar = tqdm(total=total, desc="teacher logits", unit="tok", dynamic_ncols=True)
    for shard in shards:
        path = shard_path(state, shard, k)
        if path.exists():
            part = torch.load(path, weights_only=True)
        else:
            if runner is None:
                rows = 2 * max(tokens_per_step, max(len(s.ids) for s in sequences))
                runner = ModelRunner(loaded, rows * kv_shape(loaded.model).bytes_per_token, kind="auto")
            part = _shard(runner, shard, k, tokens_per_step)
            tmp = path.with_suffix(".tmp")
            torch.save(part, tmp)
            tmp.replace(path)
        for seq in shard:
            ids, logprobs = part[seq.id]
            out[seq.id] = TopK(ids, logprobs)
        bar.update(sum(len(s.answer) for s in shard))
    bar.close()
    return out


def _shard(runner: ModelRunner, shard: list[Sequence], k: int, tokens_per_step: int) -> dict[str, Any]:
    part: dict[str, Any] = {}
    batch: list[Sequence] = []
    for seq in sorted(shard, key=lambda s: len(s.ids)):
        if batch and sum(len(s.ids) for s in batch) + len(seq.ids) > tokens_per_step:
            part.update(_batch(runner, batch, k))
            batch = []
        batch.append(seq)
    if batch:
        part.update(_batch(runner, batch, k))
    return part


def _batch(runner: ModelRunner, batch: list[Sequence], k: int) -> dict[str, Any]:
    slots = [slot for slot in (runner.kv.allocate(len(s.ids)) for s in batch) if slot is not None]
    try:
        if len(slots) < len(batch):
            raise RuntimeError("the teacher's KV arena is too small for one batch of sequences")
        segments = [Segment(slot, s.ids[:-1], len(s.prompt) - 1) for slot, s in zip(slots, batch, strict=True)]
        logits = runner.forward(segments)
    finally:
        for slot in slots:
            runner.kv.free(slot)
    assert logits is not None
    out, row = {}, 0
    for seq in batch:
        rows = logits[row : row + len(seq.answer)]
        row += len(seq.answer)
        top = torch.log_softmax(rows, -1).topk(k, -1)
        out[seq.id] = (top.indices.to(torch.int32), top.values.to(torch.float16))
    return out
