"""The baseline: verify every draft that was sent.

In the engine (``decide``) it keeps everything without a look and learns nothing. Its ``keep``
still asks the step-time model once about the batch, so its report (predicted time,
efficiency, and whether the step fits a TPOT SLO if one is set) is comparable with AdaSpec's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.verifier.trim.base import (
    SegmentShape,
    StepTimeModel,
    TrimItem,
    TrimReport,
    check_items,
    check_slo,
    expected_accepted,
    fits,
    rate,
)


class NoTrim:
    name = "none"

    def __init__(self, tpot_slo_s: float | None = None) -> None:
        self.tpot_slo_s = check_slo(tpot_slo_s)
        self.last: TrimReport | None = None

    def keep(
        self, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape] = (),
        gap_s: float = 0.0,
    ) -> dict[str, int]:
        check_items(items)
        drafts = sum(item.drafts for item in items)
        shapes = [item.shape(item.drafts) for item in items] + list(fixed)
        predicted = model.predict(shapes) if shapes else 0.0
        tokens = len(shapes) + sum(expected_accepted(item.confidence) for item in items)
        self.last = TrimReport(drafts, drafts, tokens, predicted, rate(tokens, predicted, gap_s) if shapes else 0.0,
                               fits(predicted, self.tpot_slo_s), 1 if shapes else 0)
        return {item.session_id: item.drafts for item in items}

    def decide(self, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape]) -> dict[str, int]:
        return {}

    def observe_round(self, drafter: str, confidence: Sequence[float] | None, drafted: int, accepted: int) -> None:
        pass

    def observe_gap(self, gap_s: float) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}
