"""Drafting controllers, selected by name (the drafter's ``--controller`` flag)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.drafter.control.base import DraftController, StepDecision, StepFeatures
from services.drafter.control.fixed import FixedController
from services.drafter.control.predicted_rejection import PredictorState, RejectionStopController
from services.drafter.control.threshold import DEFAULT_THRESHOLD, ThresholdController
from services.drafter.control.throughput import ThroughputController, ThroughputState

__all__ = ["CONTROLLERS", "ControlSettings", "DraftController", "StepDecision", "StepFeatures", "make_controller"]


@dataclass(frozen=True)
class ControlSettings:
    """The controllers' tunables (drafter flags)."""

    threshold: float = DEFAULT_THRESHOLD
    adaspec: ThroughputState = field(default_factory=ThroughputState)  # shared by all sessions of a drafter
    wisp: PredictorState = field(default_factory=PredictorState)  # likewise: the predictor and its samples


#: name -> factory of a fresh per-session controller
CONTROLLERS: dict[str, Callable[[ControlSettings], DraftController]] = {
    "fixed": lambda s: FixedController(),
    "threshold": lambda s: ThresholdController(s.threshold),
    "adaspec": lambda s: ThroughputController(s.adaspec),
    "wisp": lambda s: RejectionStopController(s.wisp),
}


def make_controller(name: str, settings: ControlSettings | None = None) -> DraftController:
    """A new controller for one session; ValueError naming the choices for an unknown name."""
    try:
        factory = CONTROLLERS[name]
    except KeyError:
        raise ValueError(f"unknown controller {name!r}; choose one of: {', '.join(sorted(CONTROLLERS))}") from None
    return factory(settings or ControlSettings())
