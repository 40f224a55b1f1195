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
* **Attention.** Every query row is computed as a decode step at its position computes it: its
  scores against exactly the keys it sees, the softmax, the weights against the values
  (:func:`row_attention`). The same kernels on the same shapes and data give the same bits, so a
  decode step costs what it costs without invariance, and a verification of n tokens runs n rows.
* **Per-row operations** (RMSNorm, rotary, SiLU, the residual adds) are elementwise or reduce
  one row at a time, and stay so; :meth:`ModelRunner.check_invariance` proves the whole forward
  on the loaded model at start-up, bitwise, and the verifier refuses to serve if it fails.
"""

from __future__ import annotations

import torch

from shared.runner.matmul import Matmul, matmul
from shared.runner.step import StepPlan, attend_row

#: row counts the linear probe compares (the step shapes a verifier meets: decode, rounds, prefill)
_PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 17, 19, 34)
_CANDIDATES = (1, 2, 4, 8, 16, 32)


@torch.inference_mode()
def probe_row_multiples(shapes: list[tuple[int, int]], dtype: torch.dtype,
                        device: torch.device) -> dict[tuple[int, int], int]:
    """For each ``(in, out)`` shape, the smallest row multiple for which its matmul (the kernel the
    lean forward runs: :func:`shared.runner.matmul.matmul`) gives each row bitwise the same result
    at any position in any number of rows (rounded up to that multiple); 0 where none does. Each
    shape gets its own: a 1-row step pays for padding only in the matmuls that need it."""
    gen = torch.Generator().manual_seed(0)
    found = {}
    for inp, out in dict.fromkeys(shapes):
        weight = matmul(torch.randn((out, inp), generator=gen).mul_(0.05).to(device=device, dtype=dtype))
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
