"""The lean forward's matmuls: each weight matrix once, multiplied the way that streams it fastest here.

On a CPU, oneDNN multiplies by a weight it has reordered once into its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the path torch.compile's CPU freezing takes) much
faster than by the plain row-major matrix ``F.linear`` reads: measured on one core over a decode
pass of SmolLM2's 121 matrices, 23 ms against 38 ms in bfloat16, 41 ms against 47 ms in float32,
and in float32 a 4-row product costs what a 1-row one does (the plain MKL path pays twice as much,
which made batch invariance's padding expensive). The reordered copy is made once, at load; the
transformers model keeps its own weights (the reference the runner checks itself against), so the
weights' memory doubles on a CPU.

Rows: a matmul over ``rows`` is run over ``rows`` rounded up to its ``multiple`` (zero rows pad
it, then are dropped): with the multiple :func:`shared.runner.invariant.probe_row_multiples`
finds for its shape, a row's result does not depend on the step it sits in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shared.log import get_logger
from shared.runner.kv import round_up

log = get_logger("runner.matmul")
#: the row count oneDNN lays a reordered weight out for. Measured on one core: 1-row products cost
#: the same at 1, 2 or 16; in float32, a layout for 1 row makes every 1-row product differ from the
#: same row's in a wider step (batch invariance then pads every matmul to 2 rows), one for 2 or
#: more only in a 1536-wide input's (then only that matmul pads).
PACK_ROWS = 16


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's reordered-weight matmul runs here, natively, for ``dtype``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(ops._is_mkldnn_bf16_supported())


class Matmul:
    """``x @ weight.T + bias`` for one weight matrix, in the weight's dtype (the one place a forward
    rounds its activations to it). ``pack``: oneDNN's reordered copy of the weight (see the module)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, multiple: int = 0) -> None:
        self.dtype = weight.dtype
        self.multiple = multiple  # > 1: rows are padded up to a multiple of this (batch invariance)
        self.in_features = weight.shape[1]
        self.bias = bias.detach() if bias is not None else None
        self.packed = pack
        self.source = weight.detach()  # the model's own weight (shares its storage)
        self.weight: Any = torch.ops.mkldnn._reorder_linear_weight(self.source, PACK_ROWS) if pack else self.source

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        rows = x.shape[0]
        padded = round_up(rows, self.multiple) if self.multiple > 1 else rows
        if padded != rows:
            grown = x.new_zeros((padded, x.shape[1]))
            grown[:rows] = x
            x = grown
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        else:
            out = F.linear(x, self.weight, self.bias)
        return out[:rows] if padded != rows else out


def matmul(weight: torch.Tensor, bias: torch.Tensor | None = None, multiple: int = 0) -> Matmul:
    """A :class:`Matmul` packed wherever oneDNN can (falls back to ``F.linear`` with one log line if
    the reorder fails on this machine)."""
    if packing_available(weight.device, weight.dtype):
        try:
            return Matmul(weight, bias, pack=True, multiple=multiple)
        except RuntimeError as exc:
            if not _failed:
                log.warning("oneDNN could not reorder a weight; using plain matmuls", shape=list(weight.shape),
                            dtype=str(weight.dtype), reason=str(exc)[:200])
            _failed.append(str(exc))
    return Matmul(weight, bias, pack=False, multiple=multiple)


_failed: list[str] = []  # reorders that failed in this process (logged once)
