"""Stop at the first predicted rejection (``--controller wisp``): WISP's intelligent drafting
controller (wisp.txt §4.1).

After each drafted token, the rejection predictor (``rejection_predictor.py``) reads the
draft model's logit statistics; when it predicts the token rejected, drafting stops for this
round. The token is still sent: its draft compute is spent, it is accepted often enough to be
worth one verification slot, and a rejected token costs no output (the verifier's own token
replaces it). What stopping saves is drafting, and verifying, the tokens after it.

Learning (all sessions of one drafter share a ``PredictorState``):

* every verdict labels the round's drafted positions (``round_labels``) and adds them to a
  bounded window of samples, optionally appended to a CSV file (``--wisp-samples``) that
  ``specfleet wisp-train`` turns into a predictor offline (``--wisp-model``);
* every ``train_after`` new samples, a background thread retrains the predictor on the window
  and swaps it in, logging its accuracy, AUC and FPR on a held-out fifth;
* until there is a predictor the controller drafts the whole budget, like the fixed baseline.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from services.drafter.control.base import StepDecision, StepFeatures, keep_until_stop
from services.drafter.control.rejection_predictor import (
    FEATURES,
    RejectionMLP,
    evaluate,
    feature_row,
    round_labels,
    split,
    train,
)
from shared.log import get_logger

log = get_logger("drafter.wisp")

#: samples kept for background training (the most recent)
WINDOW = 20_000
#: share of a training window held out to report the predictor's quality
HELD_OUT = 0.2


@dataclass
class PredictorState:
    """The predictor and the samples of one drafter."""

    model: RejectionMLP | None = None
    train_after: int = 2000  # retrain after this many new samples; 0: never (a fixed --wisp-model)
    samples_path: Path | None = None
    trainings: int = field(init=False, default=0)
    _rows: deque[list[float]] = field(init=False, default_factory=lambda: deque(maxlen=WINDOW))
    _labels: deque[int] = field(init=False, default_factory=lambda: deque(maxlen=WINDOW))
    _new: int = field(init=False, default=0)
    _file: IO[str] | None = field(init=False, default=None)
    _thread: threading.Thread | None = field(init=False, default=None)

    def record(self, rows: list[list[float]], labels: list[int]) -> None:
        """Add a round's labelled samples (event-loop thread); may start a background training."""
        for row, label in zip(rows, labels, strict=False):
            self._rows.append(row)
            self._labels.append(label)
            self._write(row, label)
        self._new += min(len(rows), len(labels))
        if self.train_after and self._new >= self.train_after and not self.training:
            self._new = 0
            x, y = np.asarray(self._rows, dtype=np.float64), np.asarray(self._labels, dtype=np.int64)
            self._thread = threading.Thread(target=self._train, args=(x, y), name="wisp-train", daemon=True)
            self._thread.start()

    @property
    def training(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_trained(self, timeout_s: float | None = None) -> None:
        """Wait for a background training in progress (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        """Close the samples file (drafter shutdown)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _train(self, x: np.ndarray, y: np.ndarray) -> None:
        x_train, y_train, x_test, y_test = split(x, y, HELD_OUT)
        if len(np.unique(y_train)) < 2 or len(np.unique(y_test)) < 2:
            log.info("WISP predictor not trained yet: the samples hold one class only", samples=len(y))
            return
        model = train(x_train, y_train)
        report = evaluate(model.accept_prob(x_test), y_test, model.threshold)
        self.model, self.trainings = model, self.trainings + 1
        log.info("WISP predictor trained", samples=len(y), held_out=report.n, accuracy=round(report.accuracy, 4),
                 auc=round(report.auc, 4), fpr=round(report.fpr, 4), rec1=round(report.rec1, 4))

    def _write(self, row: list[float], label: int) -> None:
        if self.samples_path is None:
            return
        if self._file is None:
            new = not self.samples_path.exists() or self.samples_path.stat().st_size == 0
            self._file = self.samples_path.open("a", buffering=1)  # line-buffered: a killed drafter loses no rows
            if new:
                self._file.write(",".join([*FEATURES, "accepted"]) + "\n")
        self._file.write(",".join(f"{v:.6g}" for v in row) + f",{label}\n")


class RejectionStopController:
    name = "wisp"
    wants_features = True
    wants_spread = True

    def __init__(self, shared: PredictorState) -> None:
        self.shared = shared
        self._rows: list[list[float]] = []

    def begin_round(self, budget: int) -> int:
        self._rows = []
        return max(0, budget)

    def on_step(self, step: StepFeatures) -> StepDecision:
        row = feature_row(step)
        self._rows.append(row)
        return self._decide(row)

    def keeps(self, steps: Sequence[StepFeatures], budget: int) -> int:
        return keep_until_stop(lambda step: self._decide(feature_row(step)), steps, budget)

    def _decide(self, row: list[float]) -> StepDecision:
        model = self.shared.model  # swapped whole by the training thread
        return StepDecision.STOP if model is not None and model.predicts_rejection(row) else StepDecision.CONTINUE

    def end_round(self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        if len(self._rows) >= drafted:  # features of every sent token (none for a draft made elsewhere)
            self.shared.record(self._rows[:drafted], round_labels(drafted, accepted))
        self._rows = []
