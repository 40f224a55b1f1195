"""specfleet's own matmul for CPUs with AVX2 and FMA (``rowwise.cpp``), built once with torch's C++
extension builder (g++ and ninja) and cached: ``specfleet build-kernels`` builds it ahead (``make
install`` does) and checks it. Float32 activations and sums, over float32 or bfloat16 weights (the
latter widened exactly in registers: half the bytes stream). On a CPU with AVX512-BF16, bfloat16
weights are packed in input pairs instead, each output one chain of the native bfloat16 dot product
(``vdpbf16ps``) over activations rounded to bfloat16, as oneDNN's bfloat16 matmul rounds them: as
invariant, at the weight's bytes for decode and near oneDNN's rate for verification's many rows. On a
CPU with AMX too, the same packed pairs multiply on its tiles (``amx.cpp``) at every row count, so
verification's many rows cost about the weight's bytes as well.
The same file holds the fused decoder block, :func:`layer`, built on it.

Each output is one fused multiply-add chain over the inputs, in order, in one vector lane, so a
row's result cannot depend on the other rows of the step: batch invariance needs no padding. The
weight is packed once into panels of 16 outputs. Measured on one core of an AVX2 EPYC (Zen 1),
one pass over SmolLM2-135M's matrices took 34.6 ms on 1 row against oneDNN's 61.1, 50.1 against
80.0 on 4, 137.6 against 179.6 on 16 and 598 against 649 on 80 (2026-12-04).

Where it cannot be built (no compiler, no AVX2/FMA), :func:`available` says why, once, in the log,
and :func:`shared.runner.matmul.matmul` uses oneDNN's kernels instead.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shared.log import get_logger

log = get_logger("runner.rowwise")
SOURCE = Path(__file__).with_name("rowwise.cpp")
SOURCES = [SOURCE, SOURCE.with_name("quant4.cpp"), SOURCE.with_name("amx.cpp")]  # the 4-bit weights; AMX
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]  # no fast-math: the chain's order is the contract


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def why_unavailable() -> str:
    """Why the kernel cannot run here ("" when it can): built, or loaded from the cache, on first call."""
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()  # every AVX2 CPU has F16C; a float16 KV arena needs it
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))}"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler (g++) to build it"
    try:
        _load()
    except Exception as exc:  # any build failure means: use oneDNN
        last = str(exc).strip().splitlines()[-1:] or [repr(exc)]
        return f"building it failed: {last[0][:300]}"
    return ""


def available() -> bool:
    """Whether the kernel runs here; the first refusal is logged with its reason."""
    why = why_unavailable()
    if why and not _told:
        log.warning("specfleet's row-wise kernel is unavailable; using oneDNN's", reason=why)
        _told.append(why)
    return not why


_told: list[str] = []


def build_dir() -> Path:
    """Where the built kernel is cached: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/specfleet/kernels``,
    one folder per torch version (a kernel built against another torch does not load)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "specfleet" / "kernels")
    return root / f"rowwise-torch-{torch.__version__}"


@functools.cache
def _load() -> Any:
    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    return load("specfleet_rowwise", [str(s) for s in SOURCES], extra_cflags=CFLAGS, build_directory=str(where),
                verbose=False)


@functools.cache
def pairs_available() -> bool:
    """Whether bfloat16 weights multiply here as bfloat16 pairs on AVX512-BF16's dot product."""
    return "avx512_bf16" in _cpu_flags() and bool(_load().pairs_supported())


@functools.cache
def amx_available() -> bool:
    """Whether bfloat16 pairs multiply on AMX here (``amx.cpp``), at every row count: a CPU whose CPUID
    lists AMX-BF16, where Linux grants the process its tiles. A verification's many rows then cost about what
    one row does (the weight's bytes), where the dot product's chains grow with the rows."""
    return pairs_available() and bool(_load().amx_supported())  # the kernel's own test: what it dispatches on


def linear_pairs(x: torch.Tensor, packed: torch.Tensor, out_features: int, amx: bool) -> torch.Tensor:
    """:func:`linear` of a pairs weight on AMX (``amx``, where :func:`amx_available`) or on the dot
    product's chains: each batch-invariant, in bits of its own."""
    return _load().linear_pairs(x, packed, out_features, amx)


def pack(weight: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """``weight`` ([out, in], float32 or bfloat16, CPU) packed for :func:`linear` (a copy in its dtype:
    out rounded up to 16). ``pairs`` (default: a bfloat16 weight of an even width where
    :func:`pairs_available`): packed in input pairs for AVX512-BF16's dot product, which rounds the
    activations to bfloat16; otherwise widened to float32 in registers, with float32 activations."""
    if pairs is None:
        pairs = weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and pairs_available()
    return _load().pack(weight.detach(), pairs)


def is_pairs(packed: torch.Tensor) -> bool:
    """Whether :func:`pack` packed this weight in bfloat16 pairs."""
    return packed.dim() == 3 and packed.dtype == torch.bfloat16 and packed.shape[2] == 32


#: inputs per 4-bit block (Q4_1's): a scale and a minimum each
Q4_BLOCK = 32


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] (in a multiple of 32) in Q4_1's blocks, as llama.cpp's quantizer makes them:
    per 32 inputs of an output, m = the least weight and d = (the largest - m) / 15, both float16, and
    codes q = round((w - m) / d), 0 to 15. Returns (codes uint8 [out, in], d, m float16 [out, in / 32]).
    A weight that is itself Q4_1's dequantized (d * q + m in float32, as transformers loads a Q4_1
    GGUF) gets its file's very blocks back: each block's least code is 0 and its largest 15."""
    out, width = weight.shape
    if width % Q4_BLOCK:
        raise ValueError(f"4-bit blocks need a width that is a multiple of {Q4_BLOCK}, not {width}")
    w = weight.detach().float().reshape(out, width // Q4_BLOCK, Q4_BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    codes = ((w - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(out, width), d, m


def pack_q4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in 4-bit blocks (:func:`q4_blocks`) packed for :func:`linear` and :func:`layer`:
    its products quantize the activations to int8 per block of 32 (``quant4.cpp``)."""
    codes, d, m = q4_blocks(weight)
    return _load().pack_q4(codes, d.view(torch.int16), m.view(torch.int16))


def q4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight :func:`pack_q4` multiplies by: d * q + m per block."""
    codes, d, m = q4_blocks(weight)
    out, width = weight.shape
    q = codes.reshape(out, width // Q4_BLOCK, Q4_BLOCK).float()
    return (d.float().unsqueeze(-1) * q + m.float().unsqueeze(-1)).reshape(out, width)


def is_q4(packed: torch.Tensor) -> bool:
    """Whether :func:`pack_q4` packed this weight."""
    return packed.dim() == 3 and packed.dtype == torch.uint8


def linear_q4(x: torch.Tensor, packed: torch.Tensor, out_features: int, wide: bool) -> torch.Tensor:
    """:func:`linear` of a 4-bit weight on AVX512-VNNI (``wide``, where :func:`q4_vnni`) or on AVX2."""
    return _load().linear_q4(x, packed, out_features, wide)


def q4_vnni() -> bool:
    """Whether 4-bit products run on AVX512-VNNI here (else on AVX2: the same bits)."""
    return bool(_load().q4_vnni())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ weight.T`` for a weight :func:`pack` packed; ``x`` is [rows, in] float32."""
    return _load().linear(x, packed, out_features)


Tensor = torch.Tensor


def layer(norm_in: Tensor, qkv: Tensor, qkv_bias: Tensor | None, o: Tensor, o_bias: Tensor | None, norm_post: Tensor,
          gate_up: Tensor, gate_up_bias: Tensor | None, down: Tensor, down_bias: Tensor | None, q_norm: Tensor | None,
          k_norm: Tensor | None, *, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
          scale: float) -> Any:
    """A Llama-family decoder block run as one C++ call per step (``rowwise.cpp``'s ``Layer``): its
    ``forward(x, cos, sin, kv, rows, spans)`` updates the residual stream ``x`` in place. The
    matrices are :func:`pack`'s; the norms and biases float32, contiguous."""
    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().float().contiguous()

    return _load().Layer(flat(norm_in), qkv, flat(qkv_bias), o, flat(o_bias), flat(norm_post), gate_up,
                         flat(gate_up_bias), down, flat(down_bias), flat(q_norm), flat(k_norm), heads, kv_heads,
                         head_dim, intermediate, eps, scale)


def main() -> int:
    """Build (or load) the kernel, check it, and time it against oneDNN's on one thread."""
    started = time.perf_counter()
    why = why_unavailable()
    if why:
        print(f"specfleet's row-wise kernel is unavailable here: {why}; the runner uses oneDNN's", file=sys.stderr)
        return 1
    print(f"row-wise kernel ready in {time.perf_counter() - started:.1f} s ({build_dir()})")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(3000, 576, generator=gen), torch.randn(7, 576, generator=gen)
    packed = pack(weight)
    got, want = linear(x, packed, 3000), x.double() @ weight.double().T
    err = float((got - want).abs().max())
    if err > 1e-3 or not torch.equal(linear(x[3:4], packed, 3000), got[3:4]):
        print(f"row-wise kernel check failed (max error {err:.2e})", file=sys.stderr)
        return 1
    print(f"checked: max error {err:.1e} against float64, row 4 of 7 bitwise equal alone")
    return 0
