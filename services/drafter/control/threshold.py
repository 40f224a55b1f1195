"""Confidence threshold: stop drafting when the draft model is unsure.

After each drafted token, if the draft model's top probability is below the threshold, the
token is kept and drafting stops for this round, as transformers' assisted generation does with
``assistant_confidence_threshold``. A cheap, stateless rule: low confidence predicts rejection.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.drafter.control.base import StepDecision, StepFeatures, keep_until_stop

DEFAULT_THRESHOLD = 0.4


class ThresholdController:
    name = "threshold"
    wants_features = True
    wants_spread = False

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def begin_round(self, budget: int) -> int:
        return max(0, budget)

    def on_step(self, step: StepFeatures) -> StepDecision:
        return StepDecision.STOP if step.top1_prob < self.threshold else StepDecision.CONTINUE

    def keeps(self, steps: Sequence[StepFeatures], budget: int) -> int:
        return keep_until_stop(self.on_step, steps, budget)  # stateless: on_step is the screen

    def end_round(self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        return None
