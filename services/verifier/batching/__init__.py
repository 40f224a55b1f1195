"""Batch selection policies, selectable by name (``--batching``)."""

from __future__ import annotations

from services.verifier.batching.base import BatchLimits, BatchPolicy, Candidate, SloClock, slo_met
from services.verifier.batching.deadline import DEFAULT_DELTA_S, DeadlineBatcher, SumsTimeModel
from services.verifier.batching.fcfs import FcfsBatcher

POLICIES = ("fcfs", "wisp")


def make_batcher(name: str, model: SumsTimeModel | None = None, default_slo_tokens_per_s: float | None = None, *,
                 delta_s: float = DEFAULT_DELTA_S, kv_budget_tokens: int | None = None,
                 network_s: float = 0.0) -> BatchPolicy:
    """The policy called ``name``. FCFS ignores the rest; WISP needs a verification-time ``model``."""
    if name == "fcfs":
        return FcfsBatcher()
    if name == "wisp":
        if model is None:
            raise ValueError("batching policy 'wisp' needs a verification-time model (the step-time estimator)")
        return DeadlineBatcher(model, default_slo_tokens_per_s, delta_s=delta_s, kv_budget_tokens=kv_budget_tokens,
                           network_s=network_s)
    raise ValueError(f"unknown batching policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = [
    "POLICIES",
    "BatchLimits",
    "BatchPolicy",
    "Candidate",
    "DeadlineBatcher",
    "FcfsBatcher",
    "SloClock",
    "SumsTimeModel",
    "make_batcher",
    "slo_met",
]
