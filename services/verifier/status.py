"""``GET /status``: which policies a verifier runs and what they currently believe, as JSON."""

from __future__ import annotations

from dataclasses import asdict

from services.verifier.allocation import Allocator, GoodputTracker, draft_share
from services.verifier.batching.estimator import FEATURES, StepTimeEstimator
from services.verifier.scheduler import Scheduler


def policy_status(allocator: Allocator, scheduler: Scheduler, tracker: GoodputTracker,
                  estimator: StepTimeEstimator) -> dict[str, object]:
    out: dict[str, object] = {
        "allocation": allocator.name,
        "batching": scheduler.batcher.name,
        "trim": scheduler.trim.name,
        "fill": scheduler.fill.name,
        "sessions": len(tracker.sessions),
        "rounds": tracker.rounds,
        "utility_sum_log_x": round(tracker.sum_log_x(), 6),
        "drafters": {name: asdict(s) for name, s in sorted(tracker.by_drafter().items())},
        "committed_by_drafter": dict(sorted(tracker.committed_by_drafter.items())),
        "estimator": {"fitted": estimator.fitted, "coef": dict(zip(FEATURES, estimator.coef, strict=True)),
                      "target_only": estimator.target_only.table(),
                      # busy seconds between forwards, e0 + e1 · sessions (None before any step)
                      "between_forwards": ([estimator.overhead.e0, estimator.overhead.e1]
                                           if estimator.overhead.points else None)},
        "last_batch_decision_s": scheduler.last_decision_s,
        "draft_share": draft_share(allocator, tracker),  # of new requests, wanted drafted for (FleetStatus)
    }
    out.update(scheduler.trim.status())  # what the trim has learned (AdaSpec: its calibration and gap)
    last_k = getattr(allocator, "last_k", None)
    if last_k is not None:  # SmartSpec: the length it chose last, and that length's predicted goodput
        out["smartspec"] = {"k": last_k, "goodput_tok_s": round(getattr(allocator, "last_goodput", 0.0), 3),
                            **getattr(allocator, "beliefs", dict)()}
    return out
