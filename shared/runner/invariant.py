"""Batch invariance: a position's logits do not depend on the shape of the step that computed them.

Speculation promises the target's own text. A verification step scores k + 1 positions of a
session at once, beside other sessions; plain decoding scores one. If a kernel chooses its
reduction order from the shape of its inputs, the same position gets slightly different logits
in the two cases, and in bfloat16 that flips a near-tied argmax every few hundred tokens
(measured on SmolLM2: 4 of 240 positions with SDPA). So every reduction of the forward runs in
an order fixed by the position alone:

* **Linear layers.** A row's result must not depend on how many rows the matmul holds, nor on
  where among them it sits. Kernels often take a matrix-vector path for one row and another for
  several (MKL's float32 ones needed every matmul padded to 4 rows on an AVX2 machine; oneDNN's,
  on reordered weights, pad only a 1536-wide input's to 2 rows here).
  :func:`probe_row_multiples` finds the smallest such multiple for this machine and each of the
  model's shapes, and :class:`shared.runner.matmul.Matmul` pads each step's rows up to it.
* **Attention.** A query row's shapes are fixed by its own length: it attends over its length
  rounded up to :data:`KEY_BLOCK` keys, the keys past its length masked (:func:`grouped_attention`).
  The rows of one segment that round up to the same block run as one batched product, padded to
  a row multiple that :func:`probe_attention_multiple` finds for this machine (as the linear
  layers are), so a verification of n tokens costs one or two products, not n. Every slot's rows
  up to that block hold finite numbers (:func:`clear_key_padding`), so a masked key weighs exactly
  0. Where no multiple works, every row runs alone as a decode step computes it
  (:func:`row_attention`).
* **Per-row operations** (RMSNorm, rotary, SiLU, the residual adds) are elementwise or reduce
  one row at a time, and stay so; :meth:`ModelRunner.check_invariance` proves the whole forward
  on the loaded model at start-up, bitwise, and the verifier refuses to serve if it fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.runner.kv import KVArena, round_up
from shared.runner.matmul import Matmul, matmul
from shared.runner.step import AttnSpan, Segment, StepPlan, attend_row, softmax

#: row counts the linear probe compares (the step shapes a verifier meets: decode, rounds, prefill)
_PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 17, 19, 34)
_CANDIDATES = (1, 2, 4, 8, 16, 32)


@torch.inference_mode()
def probe_row_multiples(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                        kernel: str = "auto") -> dict[tuple[int, int], int]:
    """For each ``(in, out)`` shape, the smallest row multiple for which its matmul (the kernel the
    lean forward runs: :func:`shared.runner.matmul.matmul`) gives each row bitwise the same result
    at any position in any number of rows (rounded up to that multiple); 0 where none does. Each
    shape gets its own: a 1-row step pays for padding only in the matmuls that need it."""
    gen = torch.Generator().manual_seed(0)
    found = {}
    for inp, out in dict.fromkeys(shapes):
        weight = matmul(torch.randn((out, inp), generator=gen).mul_(0.05).to(device=device, dtype=dtype),
                        kernel=kernel)
        x = torch.randn((max(_PROBE_ROWS), inp), generator=gen).to(device=device, dtype=dtype)
        found[(inp, out)] = next((c for c in _CANDIDATES if _rows_invariant(weight, x, c)), 0)
    return found


def _rows_invariant(weight: Matmul, x: torch.Tensor, multiple: int) -> bool:
    weight.multiple = multiple
    alone = torch.cat([weight(x[i : i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(weight(x[:rows]), alone[:rows]) for rows in _PROBE_ROWS)


def row_attention(q: torch.Tensor, kv: torch.Tensor, plan: StepPlan, scale: float) -> torch.Tensor:
    """Attention as :func:`shared.runner.step.paged_attention`, each query row computed as the decode
    step at its position computes it (:func:`shared.runner.step.attend_row` over the keys it sees),
    so a row's arithmetic cannot depend on the step it sits in. A decode step costs what it costs
    without invariance; a verification of n tokens runs n such rows."""
    out = torch.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)
    no_bias = torch.zeros((1, 1, 1), dtype=q.dtype, device=q.device)
    for span in plan.spans:
        past = span.kv_len - span.n
        for i in range(span.n):
            row = span.q_start + i
            attend_row(q[row], kv, span.kv_start, past + i + 1, scale, out[row], no_bias)
    return out


# --- attention, grouped by key block ------------------------------------------------------------

#: a query row attends over its length rounded up to a multiple of this many keys (the rest masked)
KEY_BLOCK = 16
_ATTN_CANDIDATES = (1, 2, 4, 8)
#: (cached keys, new rows) of the sessions the attention probe steps together
_ATTN_PROBE = ((0, 9), (3, 2), (13, 5), (40, 17), (100, 3), (127, 8))


def block_keys(length: int) -> int:
    """The keys a row of this length attends over: its length rounded up to :data:`KEY_BLOCK`."""
    return round_up(length, KEY_BLOCK)


@dataclass(frozen=True)
class RowGroup:
    """Consecutive rows of one segment whose lengths round up to the same key block: one product."""

    kv_start: int  # the slot's first arena row
    keys: int  # the block every row of the group attends over
    first: int  # the group's first row in the padded layout
    rows: int  # its rows there: the real ones, then padding up to the attention multiple


@dataclass(frozen=True)
class GroupedPlan:
    """The step's query rows laid out group by group, each group's block ``[kv_heads, rows, heads
    per kv head, D]`` contiguous, so every product reads and writes plain tensors."""

    groups: list[RowGroup]
    padded_rows: int
    index: torch.Tensor  # [T * kv_heads]: where each flat (row, kv head) sits in the padded layout
    masks: list[torch.Tensor]  # per group, additive [rows * heads per kv head, keys]: -inf past each row's length


def group_rows(spans: Sequence[AttnSpan], multiple: int, kv_heads: int, heads_per_kv: int, dtype: torch.dtype,
               device: torch.device) -> GroupedPlan:
    """Lay the step's query rows out for :func:`grouped_attention` (once per step, for every layer)."""
    groups: list[RowGroup] = []
    seen: list[int] = []  # keys each padded row sees (padding: key 0 only)
    where: list[int] = []  # padded layout row of each (flat row, kv head)
    first = 0
    for span in spans:
        lengths = range(span.kv_len - span.n + 1, span.kv_len + 1)  # the keys each new row sees
        i = 0
        while i < span.n:
            keys = block_keys(lengths[i])
            j = i + 1
            while j < span.n and block_keys(lengths[j]) == keys:
                j += 1
            rows = round_up(j - i, multiple)
            groups.append(RowGroup(span.kv_start, keys, first, rows))
            seen.extend([*lengths[i:j], *[1] * (rows - (j - i))])
            base = first * kv_heads  # the block is [kv_heads, rows, ...]: head h of row r at base + h * rows + r
            where.extend(base + h * rows + r for r in range(j - i) for h in range(kv_heads))
            first += rows
            i = j
    longest = max(g.keys for g in groups)
    past = torch.arange(longest, device=device) >= torch.tensor(seen, device=device).unsqueeze(1)
    mask = torch.zeros(past.shape, dtype=dtype, device=device).masked_fill_(past, float("-inf"))
    mask = mask.repeat_interleave(heads_per_kv, 0)
    masks = [mask[g.first * heads_per_kv : (g.first + g.rows) * heads_per_kv, : g.keys].contiguous() for g in groups]
    return GroupedPlan(groups, first, torch.tensor(where, dtype=torch.long, device=device), masks)


def grouped_attention(q: torch.Tensor, kv: torch.Tensor, plan: GroupedPlan, scale: float) -> torch.Tensor:
    """Attention of the flat queries ``q [T, H, D]`` over one layer of the arena ``kv [2, kv_heads,
    tokens, D]``, one batched product per :class:`RowGroup`. Returns ``[T, H * D]``. A row's
    arithmetic is fixed by its own length (its key block) and the padded row count, never by the
    step around it; the runner's start-up check proves it on the loaded model."""
    tokens, heads, dim = q.shape
    kv_heads = kv.shape[1]
    per_kv = heads // kv_heads
    padded = q.new_zeros((plan.padded_rows * kv_heads, per_kv * dim))
    padded.index_copy_(0, plan.index, q.reshape(tokens * kv_heads, per_kv * dim))
    out = torch.empty_like(padded)
    for g, mask in zip(plan.groups, plan.masks, strict=True):
        keys = kv[:, :, g.kv_start : g.kv_start + g.keys]  # a view: [2, kv_heads, keys, D]
        block = slice(g.first * kv_heads, (g.first + g.rows) * kv_heads)
        scores = torch.baddbmm(mask, padded[block].view(kv_heads, -1, dim), keys[0].transpose(1, 2), alpha=scale)
        torch.bmm(softmax(scores), keys[1], out=out[block].view(kv_heads, -1, dim))
    return out.index_select(0, plan.index).view(tokens, heads * dim)


def clear_key_padding(segments: Sequence[Segment], arena: KVArena) -> None:
    """Zero each slot's rows from what this step writes up to its key block, where no step wrote
    them yet: a masked key is then an exact 0 (torch.empty leaves whatever was there, NaN too).
    Each row is zeroed at most once per slot (``KVSlot.finite`` remembers how far)."""
    for seg in segments:
        slot = seg.slot
        end = slot.length + len(seg.tokens)
        keys = block_keys(end)
        low = max(slot.finite, end)
        if keys > low:
            arena.data[:, :, :, slot.start + low : slot.start + keys] = 0
        slot.finite = max(slot.finite, keys)


@torch.inference_mode()
def probe_attention_multiple(kv_heads: int, heads_per_kv: int, dim: int, dtype: torch.dtype,
                             device: torch.device) -> int:
    """The smallest row multiple for which :func:`grouped_attention` gives every row bitwise what a
    one-row step gives it, on sessions stepped together; 0 where none does (then attention runs
    row by row). Kernels may take another path for a product of few rows (MKL's float32 one for a
    decode step's 3 rows did, on an AVX2 machine)."""
    gen = torch.Generator().manual_seed(0)
    width = sum(block_keys(past + n) for past, n in _ATTN_PROBE)
    kv = torch.randn((2, kv_heads, width, dim), generator=gen).to(device=device, dtype=dtype)
    spans, start, q_start = [], 0, 0
    for past, n in _ATTN_PROBE:
        spans.append(AttnSpan(q_start, n, start, past + n, None))
        start, q_start = start + block_keys(past + n), q_start + n
    q = torch.randn((q_start, kv_heads * heads_per_kv, dim), generator=gen).to(device=device, dtype=dtype)

    def one_row(span: AttnSpan, i: int, multiple: int) -> torch.Tensor:  # row i of span, as a decode step
        alone = [AttnSpan(0, 1, span.kv_start, span.kv_len - span.n + i + 1, None)]
        row = q[span.q_start + i : span.q_start + i + 1]
        return grouped_attention(row, kv, group_rows(alone, multiple, kv_heads, heads_per_kv, dtype, device), 1.0)

    for multiple in _ATTN_CANDIDATES:
        together = grouped_attention(q, kv, group_rows(spans, multiple, kv_heads, heads_per_kv, dtype, device), 1.0)
        alone = torch.cat([one_row(span, i, multiple) for span in spans for i in range(span.n)])
        if torch.equal(together, alone):
            return multiple
    return 0
