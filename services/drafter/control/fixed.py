"""The static-k baseline: always draft the whole budget the verifier granted."""

from __future__ import annotations

from collections.abc import Sequence

from services.drafter.control.base import StepDecision, StepFeatures


class FixedController:
    """Drafts exactly the budget, never stops early. The baseline every adaptive policy must beat."""

    name = "fixed"
    wants_features = False  # it never stops early, so drafting skips the per-token features
    wants_spread = False

    def begin_round(self, budget: int) -> int:
        return max(0, budget)

    def on_step(self, step: StepFeatures) -> StepDecision:
        return StepDecision.CONTINUE

    def keeps(self, steps: Sequence[StepFeatures], budget: int) -> int:
        return max(0, min(len(steps), budget))

    def end_round(self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        return None
