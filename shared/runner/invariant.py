"""Batch invariance: a position's logits do not depend on the shape of the step that computed them.

Speculation promises the target's own text. A verification step scores k + 1 positions of a
session at once, beside other sessions; plain decoding scores one. If a kernel chooses its
reduction order from the shape of its inputs, the same position gets slightly different logits
in the two cases, and in bfloat16 that flips a near-tied argmax every few hundred tokens
(measured on SmolLM2: 4 of 240 positions with SDPA). So every reduction of the forward runs in
an order fixed by the position alone:

* **Linear layers.** A row's result must not depend on how many rows the matmul holds, nor on
  where among them it sits. oneDNN's bfloat16 kernels behave so; MKL's float32 kernels use a
  matrix-vector path for one row and another for a tile's last few rows (measured on an AVX2
  machine: rows are invariant once every matmul holds a multiple of 4 rows).
  :func:`probe_row_multiple` finds the smallest such multiple for this machine and the model's
  shapes, and :func:`linear` pads each step's rows up to it.
* **Attention.** Every query row is its own matrix-vector product (scores against the keys, then
  the weights against the values), so its arithmetic is the same however many rows the step
  holds. Keys come in whole blocks of :data:`BLOCK` rows: keys past a query's position are masked
  to -inf, the maximum is exact in any order, the exponentials are summed per block and the block
  sums added in order with a sequential scan. A query that sees more blocks (it sits in a wider
  step) only adds exact zeros. Slots are allocated whole blocks at a time and zeroed, so the
  masked rows are finite.
* **Per-row operations** (RMSNorm, rotary, SiLU, the residual adds) are elementwise or reduce
  one row at a time, and stay so; :meth:`ModelRunner.check_invariance` proves the whole forward
  on the loaded model at start-up, bitwise, and the verifier refuses to serve if it fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.runner.step import StepPlan

#: keys per attention block: the unit every reduction over the context works in
BLOCK = 64
#: row counts the linear probe compares (the step shapes a verifier meets: decode, rounds, prefill)
_PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 17, 19, 34)
_CANDIDATES = (1, 2, 4, 8, 16, 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiple: int) -> torch.Tensor:
    """``F.linear`` over a row count rounded up to ``multiple`` (zero rows pad the step, then are dropped)."""
    rows = x.shape[0]
    padded_rows = -(-rows // multiple) * multiple
    if padded_rows == rows:
        return F.linear(x, weight, bias)
    padded = x.new_zeros((padded_rows, x.shape[1]))
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


@torch.inference_mode()
def probe_row_multiple(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> int:
    """The smallest row multiple for which every ``(in, out)`` matmul gives each row bitwise the same
    result at any position in any number of rows (rounded up to that multiple). 0 if none does."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn((out, inp), generator=gen).mul_(0.05).to(device=device, dtype=dtype)
               for inp, out in shapes]
    inputs = [torch.randn((max(_PROBE_ROWS), inp), generator=gen).to(device=device, dtype=dtype)
              for inp, _ in shapes]
    for candidate in _CANDIDATES:
        if all(_rows_invariant(w, x, candidate) for w, x in zip(weights, inputs, strict=True)):
            return candidate
    return 0


def _rows_invariant(weight: torch.Tensor, x: torch.Tensor, multiple: int) -> bool:
    alone = torch.cat([linear(x[i : i + 1], weight, None, multiple) for i in range(x.shape[0])])
    return all(torch.equal(linear(x[:rows], weight, None, multiple), alone[:rows]) for rows in _PROBE_ROWS)


def block_attention(q: torch.Tensor, kv: torch.Tensor, plan: StepPlan, kv_heads: int, scale: float) -> torch.Tensor:
    """Attention as :func:`shared.runner.step.paged_attention`, in an order fixed per query row.

    Each query row is its own matrix-vector product against its session's keys and values (a
    batched product over a stride-0 view of them, so nothing is copied): a row's arithmetic
    cannot depend on how many rows the step holds. Each segment's slot must have room for whole
    blocks of :data:`BLOCK` rows past its valid length, holding finite values (the arena's
    aligned, zeroed slots)."""
    tokens, heads, dim = q.shape
    groups = heads // kv_heads
    out = torch.empty((tokens, heads * dim), dtype=q.dtype, device=q.device)
    for span in plan.spans:
        n, start, rows = span.n, span.q_start, span.n * groups
        blocks = -(-span.kv_len // BLOCK)
        keys = blocks * BLOCK
        cache = kv[:, :, span.kv_start : span.kv_start + keys]  # [2, kv_heads, keys, D]
        qs = q[start : start + n].view(n, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads, rows, 1, dim)
        scores = torch.empty((kv_heads, rows, 1, keys), dtype=q.dtype, device=q.device)
        for h in range(kv_heads):
            torch.bmm(qs[h], cache[0, h].t().expand(rows, dim, keys), out=scores[h])
        scores = scores.view(kv_heads, n, groups, keys).float().mul_(scale)
        scores.masked_fill_(~_visible(n, span.kv_len - n, keys, q.device).unsqueeze(1), float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # the max is exact in any order
        total = weights.view(kv_heads, n, groups, blocks, BLOCK).sum(-1).cumsum(-1)[..., -1:]  # blocks in order
        probs = weights.to(q.dtype).view(kv_heads, rows, 1, keys)
        mixed = torch.empty((kv_heads, rows, 1, dim), dtype=q.dtype, device=q.device)
        for h in range(kv_heads):
            torch.bmm(probs[h], cache[1, h].expand(rows, keys, dim), out=mixed[h])
        mixed = mixed.view(kv_heads, n, groups, dim).float().div_(total).to(q.dtype)
        out[start : start + n].view(n, kv_heads, groups, dim).copy_(mixed.transpose(0, 1))
    return out


def _visible(n: int, past: int, keys: int, device: torch.device) -> torch.Tensor:
    """[n, keys]: new token i sees keys 0 .. past + i."""
    return torch.arange(keys, device=device).unsqueeze(0) <= (past + torch.arange(n, device=device)).unsqueeze(1)
