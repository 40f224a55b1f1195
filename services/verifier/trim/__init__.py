"""Verifier-side draft trimming policies, selectable by name (``--trim``)."""

from __future__ import annotations

from services.verifier.trim.base import (
    SegmentShape,
    StepTimeModel,
    TrimItem,
    TrimPolicy,
    TrimReport,
    acceptance_chain,
    expected_accepted,
)
from services.verifier.trim.confidence import ConfidenceTrim
from services.verifier.trim.none import NoTrim

POLICIES = ("none", "adaspec")


def make_trim(name: str, tpot_slo_s: float | None = None) -> TrimPolicy:
    """A trim policy; ``tpot_slo_s`` (seconds per step) enables AdaSpec's TPOT guard, and is
    only reported against by ``none``."""
    if name == "none":
        return NoTrim(tpot_slo_s)
    if name == "adaspec":
        return ConfidenceTrim(tpot_slo_s)
    raise ValueError(f"unknown trim policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = [
    "POLICIES",
    "ConfidenceTrim",
    "NoTrim",
    "SegmentShape",
    "StepTimeModel",
    "TrimItem",
    "TrimPolicy",
    "TrimReport",
    "acceptance_chain",
    "expected_accepted",
    "make_trim",
]
