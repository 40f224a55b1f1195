"""One packed forward step over many sessions: the flat layout and the attention plan.

Every session contributes a *segment*: its new tokens (the committed tokens not yet cached,
then any drafts), written after its ``slot.length`` cached rows. The tokens of all segments are
packed into one flat sequence ``[T]`` (no padding), so the linear layers see one matrix, and
attention runs per segment over a view of that session's own arena rows:

* queries of segment b attend to rows ``[0, length_b + n_b)`` of its slot;
* new token i sees cached rows and new tokens ``0..i`` (a causal mask only when n_b > 1);
* logits are computed only for the rows a caller asks for (``logits_from``): none for a
  prefill chunk, the last committed token plus the drafts for a verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.runner.kv import KVError, KVSlot, SlotArena


@dataclass(frozen=True)
class Segment:
    slot: KVSlot
    tokens: Sequence[int]
    logits_from: int  # rows [logits_from, len(tokens)) get logits; len(tokens) for none

    @property
    def logit_rows(self) -> int:
        return len(self.tokens) - self.logits_from


class SegmentRunner(Protocol):
    """What runs packed segments over its own slots: ``shared.runner.ModelRunner`` (torch) or
    ``shared.runner.llama.LlamaRunner`` (a GGUF file on llama.cpp). The draft-model proposer drafts
    through one; the evaluations time their steps the same way."""

    vocab_size: int
    max_model_len: int

    @property
    def kv(self) -> SlotArena: ...

    def forward(self, segments: Sequence[Segment]) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class AttnSpan:
    """Where one segment sits in the flat batch and in the arena."""

    q_start: int  # first flat row of this segment
    n: int  # its new tokens
    kv_start: int  # first arena row of its slot
    kv_len: int  # rows it attends to: cached + new
    mask: torch.Tensor | None  # additive [groups * n, kv_len], rows ordered (group, token); None when n == 1


@dataclass(frozen=True)
class StepPlan:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_rows: torch.Tensor  # [T] arena rows the new keys/values go to
    spans: list[AttnSpan]
    logit_rows: torch.Tensor | None  # flat rows to compute logits for; None when every row is wanted
    rows_wanted: int


def _causal_tail_mask(n: int, past: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask for n new queries after ``past`` cached keys: query i sees keys <= past + i."""
    mask = torch.full((n, past + n), float("-inf"), dtype=dtype, device=device).triu_(past + 1)
    return mask.repeat(groups, 1) if groups > 1 else mask


def plan_step(segments: Sequence[Segment], groups: int, dtype: torch.dtype, device: torch.device) -> StepPlan:
    """Lay out ``segments`` as one flat step. Raises KVError if a segment overflows its slot."""
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    logit_rows: list[int] = []
    spans: list[AttnSpan] = []
    all_rows = True
    for seg in segments:
        n, past, slot = len(seg.tokens), seg.slot.length, seg.slot
        if n == 0:
            raise KVError("a segment must feed at least one token")
        if past + n > slot.capacity:
            raise KVError(f"a segment of {n} tokens overflows its KV slot ({past} of {slot.capacity} rows used)")
        if not 0 <= seg.logits_from <= n:
            raise KVError(f"logits_from={seg.logits_from} is outside the segment's {n} tokens")
        q_start = len(ids)
        ids.extend(seg.tokens)
        positions.extend(range(past, past + n))
        rows.extend(range(slot.start + past, slot.start + past + n))
        logit_rows.extend(range(q_start + seg.logits_from, q_start + n))
        all_rows = all_rows and seg.logits_from == 0
        mask = _causal_tail_mask(n, past, groups, dtype, device) if n > 1 else None
        spans.append(AttnSpan(q_start, n, slot.start, past + n, mask))
    as_long = {"dtype": torch.long, "device": device}
    return StepPlan(
        input_ids=torch.tensor(ids, **as_long),  # type: ignore[arg-type]
        positions=torch.tensor(positions, **as_long),  # type: ignore[arg-type]
        write_rows=torch.tensor(rows, **as_long),  # type: ignore[arg-type]
        spans=spans,
        logit_rows=None if all_rows else torch.tensor(logit_rows, **as_long),  # type: ignore[arg-type]
        rows_wanted=len(logit_rows),
    )


def commit_step(segments: Sequence[Segment]) -> None:
    """After the forward: every fed token is now cached (callers roll back rejected drafts)."""
    for seg in segments:
        seg.slot.length += len(seg.tokens)


def write_kv(kv: torch.Tensor, plan: StepPlan, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store the step's new keys and values ``[T, kv_heads, D]`` in one layer of the arena."""
    kv.index_copy_(2, plan.write_rows, torch.stack([keys, values]).transpose(1, 2))


def paged_attention(q: torch.Tensor, kv: torch.Tensor, plan: StepPlan, kv_heads: int, scale: float) -> torch.Tensor:
    """Attention of the flat queries ``q [T, H, D]`` over each segment's arena rows.

    ``kv`` is one layer of the arena, ``[2, kv_heads, tokens, D]``, with this step's new rows
    already written (see :func:`write_kv`). Returns ``[T, H * D]``. Grouped-query heads are
    folded into the query axis, so each segment costs two batched matmuls over its kv heads,
    written straight into its rows of the output. The per-segment loop is the price of
    reading each session's cache in place: a padded batch would copy every cache every step.
    """
    tokens, heads, dim = q.shape
    groups = heads // kv_heads
    out = torch.empty((tokens, heads * dim), dtype=q.dtype, device=q.device)
    no_bias = _no_bias(q)
    for span in plan.spans:
        n, start = span.n, span.q_start
        if n == 1:
            attend_row(q[start], kv, span.kv_start, span.kv_len, scale, out[start], no_bias)
            continue
        rows = kv[:, :, span.kv_start : span.kv_start + span.kv_len]  # a view: [2, kv_heads, L, D]
        qs = q[start : start + n].view(n, kv_heads, groups, dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, dim)
        scores = torch.baddbmm(span.mask, qs, rows[0].transpose(1, 2), alpha=scale)  # type: ignore[arg-type]
        attn = torch.bmm(softmax(scores), rows[1]).view(kv_heads, groups, n, dim)
        out[start : start + n].view(n, kv_heads, groups, dim).copy_(attn.permute(2, 0, 1, 3))
    return out


def attend_row(q: torch.Tensor, kv: torch.Tensor, kv_start: int, length: int, scale: float, out: torch.Tensor,
               no_bias: torch.Tensor) -> None:
    """One query row ``q [H, D]`` over arena rows ``[kv_start, kv_start + length)`` of one layer, into
    ``out [H * D]``: a decode step's attention. Its arithmetic depends on the row's own query, keys
    and values alone (the same kernels on the same shapes), which batch invariance builds on
    (:func:`shared.runner.invariant.row_attention`)."""
    kv_heads, dim = kv.shape[1], q.shape[-1]
    rows = kv[:, :, kv_start : kv_start + length]  # a view: [2, kv_heads, L, D]
    scores = torch.baddbmm(no_bias, q.view(kv_heads, -1, dim), rows[0].transpose(1, 2), beta=0.0, alpha=scale)
    torch.bmm(softmax(scores), rows[1], out=out.view(kv_heads, -1, dim))


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over keys, in float32 for half-precision models (as transformers' eager attention)."""
    return scores.softmax(-1) if scores.dtype == torch.float32 else scores.softmax(-1, torch.float32).to(scores.dtype)


def _no_bias(like: torch.Tensor) -> torch.Tensor:
    """A broadcastable dummy for baddbmm with beta=0 (its values are never read)."""
    return torch.zeros((1, 1, 1), dtype=like.dtype, device=like.device)
