"""Cost models of the simulator: how long a verifier step takes, on this CPU or projected to an H100.

Both models expose the interface of the real step-time estimator
(``services.verifier.batching.estimator.StepTimeEstimator``): ``predict(shapes)`` over the
batch's :class:`SegmentShape` list and ``predict_sums(new, total_new, cached)`` over its summed
features, so the real batchers (WISP) and allocators (SmartSpec) plan with the same model the
simulator charges time with.

* ``cpu``: the real estimator (WISP eq. 19, ``T = a·ΣL_new + b·Σ(L_total·L_new) + c·ΣL_cached + d``)
  with the coefficients profiled on this machine (``make profile-verifier`` writes them to
  ``.specfleet/verifier-profile.json``); without a profile, the estimator's generic
  ``DEFAULT_COEF`` with a warning.
* ``h100``: :class:`H100Cost`, a roofline projection of one decode/verify step of a dense
  transformer on an NVIDIA H100 SXM (Llama-3-8B by default).

The drafters' and the network's costs are parameters of each drafter (``spec.DrafterSpec``).
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.verifier.batching.estimator import DEFAULT_COEF, Coef, SegmentShape, StepTimeEstimator, features

#: where ``make profile-verifier`` leaves this machine's coefficients
DEFAULT_PROFILE = Path(".specfleet/verifier-profile.json")
COST_MODELS = ("cpu", "h100")


def parse_cost_models(text: str) -> list[str]:
    """``cpu``, ``h100`` or ``cpu,h100`` as a list (an argparse type: anything else is a usage error)."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names or any(n not in COST_MODELS for n in names):
        raise argparse.ArgumentTypeError(f"cost models are {', '.join(COST_MODELS)}; got {text!r}")
    return names


class CostModel(Protocol):
    """A verifier step-time model: the real estimator's interface (``StepTimeModel`` + ``SumsTimeModel``)."""

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        """Seconds for one forward over these segments."""
        ...

    def predict_sums(self, new: float, total_new: float, cached: float) -> float:
        """Seconds for a forward with ΣL_new, Σ(L_total·L_new) and ΣL_cached as given."""
        ...


@dataclass(frozen=True)
class TransformerShape:
    """A dense decoder-only transformer; the defaults are Llama-3-8B (8.03 B parameters, 32 layers,
    hidden 4096, 32 query heads and 8 key/value heads of 128 dimensions, BF16 weights and cache)."""

    params: float = 8.03e9
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    bytes_per_value: int = 2  # BF16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> float:
        """Key and value rows of one token over all layers."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value

    @property
    def attn_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over all layers: q·k and p·v, 2 FLOPs per multiply-add each."""
        return 4.0 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class GpuSpec:
    """An accelerator's roofline. Defaults: NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100):
    3.35 TB/s HBM3 bandwidth and 989 TFLOPS dense BF16 tensor-core peak (1979 is with sparsity)."""

    hbm_bytes_per_s: float = 3.35e12
    peak_flops: float = 989e12
    hbm_efficiency: float = 1.0  # achieved share of the bandwidth (1.0: the pure roofline, a lower bound)
    flops_efficiency: float = 1.0  # achieved share of the peak
    launch_s: float = 1e-3  # fixed per-step cost: kernel launches, sampling, scheduling in the engine


class H100Cost:
    """Roofline time of one verify step of a dense transformer (weights and KV cache in HBM):

        bytes = weight_bytes + kv_bytes_per_token · (ΣL_cached + ΣL_new)       (read weights and cache once,
                                                                                 write the new rows)
        flops = 2·params·ΣL_new + attn_flops_per_pair · Σ(L_total·L_new)       (linear layers + attention)
        T     = max(bytes / (BW·hbm_eff), flops / (peak·flops_eff)) + launch

    Memory-bound at small batches (T ≈ weights/BW ≈ 4.8 ms for Llama-3-8B whatever the draft
    length: speculation is almost free to verify), compute-bound once ΣL_new reaches about
    peak/BW ≈ 300 tokens (2 FLOPs per parameter per token against 2 bytes per parameter).
    Activations, the LM head's extra cost, and overlap are ignored; attention counts each
    session's new tokens against its whole prefix (Σ L_total·L_new, as the real estimator's b
    term) rather than the causal half.
    """

    def __init__(self, model: TransformerShape | None = None, gpu: GpuSpec | None = None) -> None:
        self.model = model or TransformerShape()
        self.gpu = gpu or GpuSpec()
        if self.gpu.hbm_bytes_per_s <= 0 or self.gpu.peak_flops <= 0:
            raise ValueError("bandwidth and peak FLOPS must be > 0")
        self._bw = self.gpu.hbm_bytes_per_s * self.gpu.hbm_efficiency
        self._peak = self.gpu.peak_flops * self.gpu.flops_efficiency

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        return self.predict_sums(*features(shapes))

    def predict_sums(self, new: float, total_new: float, cached: float) -> float:
        m = self.model
        data = m.weight_bytes + m.kv_bytes_per_token * (cached + new)
        flops = 2.0 * m.params * new + m.attn_flops_per_pair * total_new
        return max(data / self._bw, flops / self._peak) + self.gpu.launch_s


def load_cpu_coef(path: str | Path | None = None) -> Coef:
    """This machine's profiled coefficients (a, b, c, d) of eq. 19, read with the real
    ``StepTimeEstimator.load``; ``DEFAULT_COEF`` with a warning when there is no usable file."""
    target = Path(path) if path else DEFAULT_PROFILE
    try:
        return StepTimeEstimator.load(target).coef
    except ValueError as exc:
        warnings.warn(f"no verifier profile ({exc}); using the estimator's generic DEFAULT_COEF",
                      stacklevel=2)
        return DEFAULT_COEF


@dataclass(frozen=True)
class CostSpec:
    """Which step-time model a simulation charges: ``kind`` "cpu" (the real estimator with
    ``coef``) or "h100" (:class:`H100Cost` with ``model`` and ``gpu``)."""

    kind: str = "cpu"
    coef: Coef = DEFAULT_COEF
    model: TransformerShape = TransformerShape()
    gpu: GpuSpec = GpuSpec()
    #: every prediction times this: a run's measured forward over the profile's estimate of it
    #: (``bench.sim.validate``), as the real verifier's online refit pulls its estimate to the
    #: forwards it measures
    scale: float = 1.0

    def build(self) -> CostModel:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"the cost scale must be a finite number > 0, got {self.scale}")
        model = self._base()
        return model if self.scale == 1.0 else ScaledCost(model, self.scale)

    def _base(self) -> CostModel:
        if self.kind == "cpu":
            if not all(math.isfinite(v) for v in self.coef):
                raise ValueError(f"cpu coefficients must be finite, got {self.coef}")
            return StepTimeEstimator(self.coef)
        if self.kind == "h100":
            return H100Cost(self.model, self.gpu)
        raise ValueError(f"unknown cost model {self.kind!r}; choose one of {', '.join(COST_MODELS)}")


class ScaledCost:
    """A cost model whose every prediction is ``scale`` times another's."""

    def __init__(self, model: CostModel, scale: float) -> None:
        self.model, self.scale = model, scale

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        return self.model.predict(shapes) * self.scale

    def predict_sums(self, new: float, total_new: float, cached: float) -> float:
        return self.model.predict_sums(new, total_new, cached) * self.scale
