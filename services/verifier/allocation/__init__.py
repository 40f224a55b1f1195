"""Draft-length allocation policies, selectable by name (``--allocation``)."""

from __future__ import annotations

from services.verifier.allocation.base import Allocator, RoundStats
from services.verifier.allocation.fixed import FixedAllocator

POLICIES = ("fixed",)


def make_allocator(name: str, draft_len: int) -> Allocator:
    if name == "fixed":
        return FixedAllocator(draft_len)
    raise ValueError(f"unknown allocation policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "Allocator", "FixedAllocator", "RoundStats", "make_allocator"]
