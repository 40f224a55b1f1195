"""Draft-length allocation policies, selectable by name (``--allocation``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.verifier.allocation.base import Allocator, RoundStats, draft_share
from services.verifier.allocation.fixed import FixedAllocator
from services.verifier.allocation.goodspeed import GoodSpeedAllocator
from services.verifier.allocation.per_drafter import PerDrafterAllocator
from services.verifier.allocation.random_split import RandomAllocator
from services.verifier.allocation.smartspec import SmartSpecAllocator
from services.verifier.allocation.tracker import GoodputTracker
from services.verifier.batching.base import BatchLimits
from services.verifier.batching.estimator import RecentLine, StepTimeModel

POLICIES = ("fixed", "random", "goodspeed", "smartspec", "smartspec-per-drafter")


@dataclass(frozen=True)
class AllocationSettings:
    draft_len: int = 4  # Fixed-S's k, and the initial length of the adaptive policies
    capacity: int = 0  # GoodSpeed's C: draft tokens per round over all sessions; 0: draft_len per session
    max_len: int = 16  # no session gets more (SmartSpec's V)
    seed: int | None = None  # Random-S
    limits: BatchLimits | None = None  # the verifier's batch limits, which SmartSpec prices (None: unlimited)
    timed_waits: bool = True  # SmartSpec prices the draft waits from the drafter's timings (draft_wait.Timed)


def make_allocator(name: str, settings: AllocationSettings, model: StepTimeModel | None = None,
                   overhead: RecentLine | None = None) -> Allocator:
    """``model`` and ``overhead`` (the verifier's busy time between forwards) price SmartSpec's rounds."""
    s = settings
    if name == "fixed":
        return FixedAllocator(s.draft_len, s.capacity)
    if name == "random":
        return RandomAllocator(s.draft_len, s.capacity, s.max_len, s.seed)
    if name == "goodspeed":
        return GoodSpeedAllocator(s.draft_len, s.capacity, s.max_len)
    if name in ("smartspec", "smartspec-per-drafter"):
        if model is None:
            raise ValueError(f"the {name} allocation needs a verification-time estimator")
        priced = model

        def smartspec() -> SmartSpecAllocator:
            return SmartSpecAllocator(priced, s.draft_len, s.max_len, overhead=overhead, limits=s.limits,
                                      timed_waits=s.timed_waits)

        return smartspec() if name == "smartspec" else PerDrafterAllocator(smartspec)
    raise ValueError(f"unknown allocation policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "AllocationSettings", "Allocator", "FixedAllocator", "GoodSpeedAllocator", "GoodputTracker",
           "PerDrafterAllocator", "RandomAllocator", "RoundStats", "SmartSpecAllocator", "draft_share",
           "make_allocator"]
