"""Drafting controllers, selected by name (the drafter's ``--controller`` flag)."""

from __future__ import annotations

from collections.abc import Callable

from services.drafter.control.base import DraftController, StepDecision, StepFeatures
from services.drafter.control.fixed import FixedController

__all__ = ["CONTROLLERS", "DraftController", "StepDecision", "StepFeatures", "make_controller"]

#: name -> factory of a fresh per-session controller
CONTROLLERS: dict[str, Callable[[], DraftController]] = {"fixed": FixedController}


def make_controller(name: str) -> DraftController:
    """A new controller for one session; ValueError naming the choices for an unknown name."""
    try:
        return CONTROLLERS[name]()
    except KeyError:
        raise ValueError(f"unknown controller {name!r}; choose one of: {', '.join(sorted(CONTROLLERS))}") from None
