"""What runs a GGUF draft: specfleet's own 4-bit kernel, or llama.cpp (``--gguf-backend``).

A GGUF copy of the target pays as a draft only if its step is a small fraction of the target's. On
one core of an AVX512-BF16 EPYC (2026-12-05), llama.cpp's Q4_1 step of SmolLM2-135M took 10.3 ms
against the target's 12.0 on specfleet's bfloat16 runner (0.87 of it: llama.cpp read its 4-bit
weights at 9.5 GB/s where the core streams 26). The ``specfleet`` backend runs the same file on
specfleet's lean runner with every matrix in Q4_1's blocks (``rowwise.pack_q4``, ``quant4.cpp``): the
weights at 5/8 of a byte each, multiplied by integer dot products at the memory's rate, 2.9 ms a
step there (0.24 of the target's).

* The file is read and dequantized to float32 (``shared.gguf_weights``: transformers' model, bit for bit),
  and every matrix is cut back into Q4_1 blocks. A Q4_1 block dequantized holds its code 0 and its
  code 15, so this gives back the file's very blocks: the draft multiplies by the file's own weights
  (:func:`q4_runner` checks it, matrix by matrix, and says how many came back exactly). Matrices of
  other types (the Q4_1 file's Q8_0 embedding, which is also its head; every matrix of a Q8_0 or Q4_0
  file) are requantized to Q4_1, with the head's 16 best logits per row recomputed from the file's own
  weights (``lean.LeanDecoder._refine_top``).
* The activations are quantized to int8 per block of 32 (llama.cpp's Q8_1 does the same), so the
  draft is an approximation of the file, as llama.cpp's is; the drafts are verified either way.
* ``auto`` picks it for a Q4_1 or a Q8_0 file on a CPU where the kernel builds, and llama.cpp
  everywhere else: other files, and llama.cpp built for a GPU (a Jetson's CUDA build). A Q8_0 file is
  cut to 4 bits here (a Q4_1 copy of its weights): SmolLM2's Q8_0 copy then agreed with the target on
  0.979 of 20,527 held-out positions (0.976 on llama.cpp), at 4.05 ms a step against llama.cpp's 9.1; with
  the default fleet's drafter-2 on it the fleet went from 1.14x to 1.73x target-only at 1 request
  (``python -m bench edge-drafts --scenarios target-only,default-fleet,fleet-4bit``, 2026-12-05 02:46).
  ``--gguf-backend llama.cpp`` keeps the file's 8 bits.
"""

from __future__ import annotations

from typing import Any

import torch

from shared.errors import ModelLoadError
from shared.gguf_files import GgufInfo
from shared.log import get_logger
from shared.models import LoadedModel
from shared.runner import rowwise
from shared.runner.step import SegmentRunner

log = get_logger("runner.gguf")
#: ``--gguf-backend``'s choices
GGUF_BACKENDS = ("auto", "specfleet", "llama.cpp")
#: the files auto runs on the ``specfleet`` backend: Q4_1 (its blocks kept exactly) and Q8_0 (cut to Q4_1:
#: SmolLM2's Q8_0 copy agreed with the target on 0.979 of 20,527 held-out positions there, against 0.976
#: on llama.cpp at twice the step: training eval-gguf, 2026-12-05). Not Q4_0: its blocks cut to Q4_1's
#: lose too much (a relative logit error of 0.37 against its own weights)
AUTO_FILE_TYPES = frozenset({"Q4_1", "Q8_0"})
#: ``--gguf-kv-cache``: the 4-bit kernel's KV cache. float16 by default, as llama.cpp keeps its own: half the
#: bytes attention reads per cached token. On an AVX512-BF16 EPYC core (2026-12-07, ``python -m bench
#: draft-steps``), a step of 8 SmolLM2 Q4_1 drafts took 1.98 ms a row at 200 tokens of context against 2.28 in
#: float32, 2.44 against 3.12 at 400. A draft need not be exact: the verifier checks every token.
KV_CACHE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def kv_cache_dtype(name: str) -> torch.dtype:
    """``--gguf-kv-cache``'s dtype; any other name is an error that lists the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"--gguf-kv-cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def resolve_backend(info: GgufInfo, backend: str) -> str:
    """``specfleet`` or ``llama.cpp`` for ``info``'s file; a backend named that cannot run it is an error."""
    if backend not in GGUF_BACKENDS:
        raise ModelLoadError(f"--gguf-backend must be one of {', '.join(GGUF_BACKENDS)}, got {backend!r}")
    if backend == "llama.cpp":
        return backend
    why = _why_not_specfleet(info)
    if backend == "specfleet" and why:
        raise ModelLoadError(f"--gguf-backend specfleet cannot run {info.name}: {why}; use --gguf-backend llama.cpp")
    if backend != "auto":
        return backend
    if why or info.file_type not in AUTO_FILE_TYPES or _llama_gpu():
        return "llama.cpp"
    return "specfleet"


def _why_not_specfleet(info: GgufInfo) -> str:
    from shared.model_import import GGUF_ARCHITECTURES

    if info.architecture not in GGUF_ARCHITECTURES:
        return f"its architecture {info.architecture!r} is not one of {sorted(GGUF_ARCHITECTURES)}"
    return rowwise.why_unavailable()


def _llama_gpu() -> bool:
    """Whether llama.cpp is installed here built for a GPU (then its drafts run there); False where it
    cannot even load (the 4-bit kernel then drafts)."""
    from shared.llama_lib import gpu_present, llama_cpp_available, llama_cpp_module

    try:
        return llama_cpp_available() and bool(gpu_present(llama_cpp_module()))
    except Exception as exc:  # a broken llama.cpp install raises more than ImportError; auto does not need it
        log.warning("llama.cpp could not be asked whether it runs on a GPU", reason=repr(exc)[:200])
        return False


def q4_runner(info: GgufInfo, kv_budget_bytes: int, self_check: bool = True,
              kv_dtype: torch.dtype = torch.float16) -> Any:
    """A :class:`shared.runner.ModelRunner` over ``info``'s file with every matrix in 4-bit blocks, its keys
    and values in ``kv_dtype``."""
    from shared.model_import import ImportModelError, gguf_float_model
    from shared.runner.runner import ModelRunner

    try:
        model = gguf_float_model(info.path)
    except ImportModelError as exc:
        raise ModelLoadError(str(exc)) from None
    loaded = LoadedModel(model=model, tokenizer=None, name=info.name, path=str(info.path.resolve()),
                         fingerprint=info.vocabulary.fingerprint, eos_ids=set(info.eos_ids),
                         max_model_len=info.context_length, vocab_size=int(model.config.vocab_size),
                         vocabulary=info.vocabulary)
    exact, total = exact_matrices(model)
    runner = ModelRunner(loaded, kv_budget_bytes, kind="lean", self_check=self_check, matmul="q4", kv_dtype=kv_dtype)
    log.info("GGUF draft on specfleet's 4-bit kernel", file=info.name, file_type=info.file_type,
             matrices_kept_exactly=f"{exact} of {total}", vnni=rowwise.q4_vnni())
    return runner


def exact_matrices(model: Any) -> tuple[int, int]:
    """How many of ``model``'s linear weights are Q4_1 blocks already (4-bit packing keeps them
    bitwise), of how many."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    kept = sum(torch.equal(rowwise.q4_dequantized(w), w.float()) for w in weights if w.shape[1] % 32 == 0)
    return kept, len(weights)


def gguf_runner(info: GgufInfo, kv_budget_bytes: int, backend: str = "auto", threads: int = 0,
                sequences: int = 16, kv_dtype: torch.dtype = torch.float16) -> SegmentRunner:
    """``info``'s draft on its backend (:func:`resolve_backend`). Under ``auto``, a file the 4-bit kernel
    cannot load (transformers refuses it, a width not a multiple of 32, the self-check) goes to llama.cpp,
    with one log line."""
    from shared.runner.llama import LlamaRunner

    if resolve_backend(info, backend) == "specfleet":
        try:
            return q4_runner(info, kv_budget_bytes, kv_dtype=kv_dtype)
        except ModelLoadError as exc:
            if backend != "auto":
                raise
            log.warning("the 4-bit kernel cannot run this GGUF draft; llama.cpp runs it", file=info.name,
                        reason=str(exc)[:300])

    return LlamaRunner(info, kv_budget_bytes, threads, sequences)

