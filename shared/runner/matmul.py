"""The lean forward's matmuls: each weight matrix once, multiplied the way that streams it fastest here.

On a CPU, oneDNN multiplies by a weight it has reordered once into its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the path torch.compile's CPU freezing takes) much
faster than by the plain row-major matrix ``F.linear`` reads: measured on one core over a decode
pass of SmolLM2's 121 matrices, 23 ms against 38 ms in bfloat16, 41 ms against 47 ms in float32,
and in float32 a 4-row product costs what a 1-row one does (the plain MKL path pays twice as much,
which made batch invariance's padding expensive). The reordered copy is made once, at load; the
transformers model keeps its own weights (the reference the runner checks itself against), so the
weights' memory doubles on a CPU.

In float32, specfleet's own kernel (:mod:`shared.runner.rowwise`) is faster still at every row
count measured (1 to 80 rows) and batch-invariant by construction; ``auto`` picks it where it builds.
It also multiplies bfloat16 weights, and ``auto`` picks it for them too: on a CPU with AVX512-BF16
in bfloat16 pairs on the native dot product (measured on one core of an AVX512-BF16 EPYC, a
batch-invariant step of SmolLM2-135M took 12.3 ms against oneDNN's 29.9 at 1 row, 44.0 against
58.7 at 20 and 154.7 against 176.3 at 80, 2026-12-04); elsewhere widened in registers (AVX2, where
oneDNN's bfloat16 is emulated and ``F.linear`` in bfloat16 was the only path). On a CPU that lists
AMX too: on a Xeon VM whose CPU lists it (2026-12-05), oneDNN's bfloat16 matmuls gave a row different
results at every row multiple probed on the real model (the verifier refused to start) and broke a
tiny Qwen3's invariance at a 44-row step that the probe had passed, where the pairs ran at 46.7
tokens/s. There the pairs run on AMX's tiles instead (``amx.cpp``), invariant by construction: a
forward of the real model with 9 rows took 25.6 ms against the dot product's 38.6, 16 sessions of 9
rows 130 against 451, and 1 row 20.5 against 19.7 (2026-12-06). ``--matmul onednn`` or ``rowwise``
asks for one; ``python -m bench decode`` compares them.

Rows: on oneDNN or ``F.linear``, a matmul over ``rows`` is run over ``rows`` rounded up to its
``multiple`` (zero rows pad it, then are dropped): with the multiple
:func:`shared.runner.invariant.probe_row_multiples` finds for its shape, a row's result does not
depend on the step it sits in. The row-wise kernel needs no padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shared.log import get_logger
from shared.runner import rowwise
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


#: the kernels a lean forward's matmuls can run (``--matmul``): ``auto`` picks ``rowwise`` for
#: float32, and for bfloat16 where oneDNN's is not native or the kernel's bfloat16 pairs run (AVX512-BF16),
#: where it builds (:mod:`shared.runner.rowwise`), else ``onednn`` where oneDNN reorders the dtype, else
#: ``plain`` (``F.linear``)
KERNELS = ("auto", "rowwise", "onednn", "plain")
#: a draft's matmuls in 4-bit blocks (``rowwise.pack_q4``: Q4_1's, as a GGUF file holds them) on the
#: row-wise kernel's integer dot products; never the verifier's (its products are approximations)
Q4 = "q4"


class Matmul:
    """``x @ weight.T + bias`` for one weight matrix, in the weight's dtype (the one place a forward
    rounds its activations to it). ``kind``: ``rowwise`` (specfleet's float32 kernel on its packed
    copy), ``onednn`` (oneDNN's reordered copy, see the module) or ``plain`` (``F.linear``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, multiple: int = 0) -> None:
        self.dtype = weight.dtype
        self.multiple = multiple  # > 1: rows are padded up to a multiple of this (batch invariance)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = bias.detach() if bias is not None else None
        self.kind = kind
        self.source = weight.detach()  # the model's own weight (shares its storage)
        self.weight: Any = (rowwise.pack(self.source) if kind == "rowwise" else
                            rowwise.pack_q4(self.source) if kind == Q4 else
                            torch.ops.mkldnn._reorder_linear_weight(self.source, PACK_ROWS) if kind == "onednn" else
                            self.source)
        #: whether the product rounds (its activations, its outputs or its weights): all but the row-wise
        #: kernel's float32 chains over a float32 or a widened bfloat16 weight
        self.rounds = kind == Q4 or (self.dtype != torch.float32
                                     and (kind != "rowwise" or rowwise.is_pairs(self.weight)))

    @property
    def packed(self) -> bool:
        """Whether the product runs on a copy of the weight laid out for its kernel."""
        return self.kind != "plain"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in ("rowwise", Q4):  # a row's result never depends on the others': no padding
            out = rowwise.linear(x.float(), self.weight, self.out_features)  # float32 sums, whatever the weight
            if self.bias is not None:
                out.add_(self.bias)
            return out if x.dtype == torch.float32 else out.to(self.dtype)
        x = x.to(self.dtype)
        rows = x.shape[0]
        padded = round_up(rows, self.multiple) if self.multiple > 1 else rows
        if padded != rows:
            grown = x.new_zeros((padded, x.shape[1]))
            grown[:rows] = x
            x = grown
        if self.kind == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        else:
            out = F.linear(x, self.weight, self.bias)
        return out[:rows] if padded != rows else out


def resolve_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel ``kernel`` (one of :data:`KERNELS`) means for ``dtype`` on ``device``. ``auto``
    falls back quietly; a kernel asked for by name that cannot run here is an error."""
    if kernel == Q4:
        why = (rowwise.why_unavailable() if device.type == "cpu" and dtype == torch.float32 else
               f"they quantize float32 weights on a CPU, not {dtype} on {device}")
        if why:
            raise ValueError(f"4-bit matmuls cannot run here: {why}")
        return Q4
    if kernel not in KERNELS:
        raise ValueError(f"--matmul must be one of {', '.join(KERNELS)}, got {kernel!r}")
    cpu = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if kernel == "rowwise" and not (cpu and rowwise.available()):
        why = (rowwise.why_unavailable() if cpu else
               f"it multiplies float32 or bfloat16 weights on a CPU, not {dtype} on {device}")
        raise ValueError(f"--matmul rowwise cannot run here: {why}; use --matmul auto")
    if kernel == "onednn" and not packing_available(device, dtype):
        raise ValueError(f"--matmul onednn cannot run {dtype} on {device} here; use --matmul auto")
    if kernel != "auto":
        return kernel
    native = packing_available(device, dtype)
    if cpu and rowwise.available() and (dtype == torch.float32 or not native or rowwise.pairs_available()):
        return "rowwise"
    return "onednn" if native else "plain"


def matmul(weight: torch.Tensor, bias: torch.Tensor | None = None, multiple: int = 0, kernel: str = "auto") -> Matmul:
    """A :class:`Matmul` on ``kernel`` (:func:`resolve_kernel`); where oneDNN's reorder fails on this
    machine, ``F.linear`` with one log line."""
    kind = resolve_kernel(kernel, weight.device, weight.dtype)
    if kind == "onednn":
        try:
            return Matmul(weight, bias, "onednn", multiple=multiple)
        except RuntimeError as exc:
            if not _failed:
                log.warning("oneDNN could not reorder a weight; using plain matmuls", shape=list(weight.shape),
                            dtype=str(weight.dtype), reason=str(exc)[:200])
            _failed.append(str(exc))
        kind = "plain"
    return Matmul(weight, bias, kind, multiple=multiple)


_failed: list[str] = []  # reorders that failed in this process (logged once)
