"""Batch selection policies, selectable by name (``--batching``)."""

from __future__ import annotations

from services.verifier.batching.base import BatchLimits, BatchPolicy, Candidate
from services.verifier.batching.fcfs import FcfsBatcher

POLICIES = ("fcfs",)


def make_batcher(name: str) -> BatchPolicy:
    if name == "fcfs":
        return FcfsBatcher()
    raise ValueError(f"unknown batching policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "BatchLimits", "BatchPolicy", "Candidate", "FcfsBatcher", "make_batcher"]
