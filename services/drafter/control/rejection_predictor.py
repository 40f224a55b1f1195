"""WISP's rejection predictor (wisp.txt §3.3, §4.1, §5.4): a small MLP on draft-logit statistics.

For each drafted token the draft model's own distribution gives a feature vector: the top-1
probability, the drafted token's probability, the entropy, the top-1/top-2 margin and the
spread (standard deviation) of the logits. A sharper distribution predicts agreement with the
target. The predictor outputs P(accepted) for the token; the WISP controller stops drafting at
the first token it predicts rejected.

Labels come from the verifier's verdicts, as the paper defines them: in a round whose first
``accepted`` drafts were accepted, those positions are 1, the first rejected position is 0,
and positions after it are ignored (verification stopped there; they say nothing).

Pure numpy, deterministic for a seed, small enough to train on an edge core in a fraction of a
second: standardised inputs, two hidden ReLU layers, a sigmoid output, class-balanced binary
cross-entropy (the data is acceptance-dominated and a missed rejection is what wastes work,
§5.4), mini-batch Adam. The decision threshold is chosen on the training split to maximise
balanced accuracy (recall on accepted + specificity on rejected, over 2).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from services.drafter.control.base import StepFeatures

#: the feature vector, in order (also the header of a samples file)
FEATURES = ("top1_prob", "token_prob", "entropy", "margin", "logit_std")
Array = NDArray[np.float64]


def feature_row(step: StepFeatures) -> list[float]:
    return [step.top1_prob, step.token_prob, step.spread.entropy, step.margin, step.spread.logit_std]


def round_labels(drafted: int, accepted: int) -> list[int]:
    """Labels for a round's drafted positions: 1 for each accepted draft, 0 for the first
    rejected one, nothing after it (never judged)."""
    accepted = max(0, min(accepted, drafted))
    return [1] * accepted + ([0] if accepted < drafted else [])


@dataclass
class RejectionMLP:
    """P(accepted) from a feature row. ``weights`` are (W, b) per layer, last layer one output."""

    mean: Array
    scale: Array
    weights: list[tuple[Array, Array]]
    threshold: float = 0.5  # predict "rejected" when P(accepted) < threshold

    def accept_prob(self, x: Array) -> Array:
        """P(accepted) for each row of ``x`` (n x len(FEATURES))."""
        return _sigmoid(self._logit(x))

    def predicts_rejection(self, row: Sequence[float]) -> bool:
        return float(self.accept_prob(np.asarray([row], dtype=np.float64))[0]) < self.threshold

    def _logit(self, x: Array) -> Array:
        h = (x - self.mean) / self.scale
        for i, (w, b) in enumerate(self.weights):
            h = h @ w + b
            if i < len(self.weights) - 1:
                h = np.maximum(h, 0.0)
        return h[:, 0]

    def save(self, path: Path) -> None:
        data = {"features": list(FEATURES), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "threshold": self.threshold, "layers": [{"w": w.tolist(), "b": b.tolist()} for w, b in self.weights]}
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> RejectionMLP:
        """Raises ValueError with what is wrong when the file is not a predictor for these features."""
        try:
            data = json.loads(path.read_text())
            if data["features"] != list(FEATURES):
                raise ValueError(f"it was trained on features {data['features']}, this drafter computes "
                                 f"{list(FEATURES)}; retrain it with `specfleet wisp-train`")
            layers = [(np.asarray(layer["w"], dtype=np.float64), np.asarray(layer["b"], dtype=np.float64))
                      for layer in data["layers"]]
            return cls(np.asarray(data["mean"], dtype=np.float64), np.asarray(data["scale"], dtype=np.float64),
                       layers, float(data["threshold"]))
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the WISP predictor {path}: {exc}") from exc


@dataclass(frozen=True)
class TrainSettings:
    hidden: int = 16
    steps: int = 1500  # mini-batch Adam steps
    batch: int = 512
    lr: float = 0.01
    seed: int = 0


def train(x: Array, y: NDArray[np.int64], settings: TrainSettings = TrainSettings()) -> RejectionMLP:
    """Fit the MLP to rows ``x`` with labels ``y`` (1 accepted, 0 rejected); needs both classes."""
    if len(x) == 0 or y.min() == y.max():
        raise ValueError("training needs both accepted and rejected samples")
    rng = np.random.default_rng(settings.seed)
    mean, scale = x.mean(0), x.std(0) + 1e-6
    sizes = [x.shape[1], settings.hidden, settings.hidden, 1]
    params = [p for a, b in itertools.pairwise(sizes)
              for p in (rng.normal(0.0, np.sqrt(2.0 / a), (a, b)), np.zeros(b))]
    weight = np.where(y == 1, len(y) / (2.0 * y.sum()), len(y) / (2.0 * (len(y) - y.sum())))
    adam = _Adam(params, settings.lr)
    xs = (x - mean) / scale
    for _ in range(settings.steps):
        idx = rng.integers(0, len(x), min(settings.batch, len(x)))
        adam.step(_gradients(params, xs[idx], y[idx].astype(np.float64), weight[idx]))
    model = RejectionMLP(mean, scale, [(params[i], params[i + 1]) for i in range(0, len(params), 2)])
    model.threshold = best_threshold(model.accept_prob(x), y)
    return model


def _gradients(params: list[Array], x: Array, y: Array, weight: Array) -> list[Array]:
    """Gradients of the mean weighted binary cross-entropy, by backpropagation."""
    acts, h = [x], x
    for i in range(0, len(params), 2):
        h = h @ params[i] + params[i + 1]
        if i < len(params) - 2:
            h = np.maximum(h, 0.0)
        acts.append(h)
    delta = ((_sigmoid(acts[-1][:, 0]) - y) * weight / len(y))[:, None]  # d loss / d logit
    grads: list[Array] = [np.empty(0)] * len(params)
    for layer in range(len(params) // 2 - 1, -1, -1):
        grads[2 * layer], grads[2 * layer + 1] = acts[layer].T @ delta, delta.sum(0)
        if layer:
            delta = (delta @ params[2 * layer].T) * (acts[layer] > 0)
    return grads


class _Adam:
    def __init__(self, params: list[Array], lr: float, b1: float = 0.9, b2: float = 0.999) -> None:
        self.params, self.lr, self.b1, self.b2, self.t = params, lr, b1, b2, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, grads: list[Array]) -> None:
        self.t += 1
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            p -= self.lr * (m / (1 - self.b1 ** self.t)) / (np.sqrt(v / (1 - self.b2 ** self.t)) + 1e-8)


def _sigmoid(z: Array) -> Array:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free


# --- evaluation: the shape of WISP's Table 4 -------------------------------------------------


@dataclass(frozen=True)
class Report:
    """Acc., AUC, Rec1 (recall on accepted: speculative coverage), Spec. (recall on rejected:
    waste control), FPR = 1 - Spec. (rejections let through), BalAcc = (Rec1 + Spec.) / 2."""

    n: int
    accuracy: float
    auc: float
    rec1: float
    spec: float

    @property
    def fpr(self) -> float:
        return 1.0 - self.spec

    @property
    def balanced_accuracy(self) -> float:
        return (self.rec1 + self.spec) / 2

    def row(self, name: str) -> str:
        return (f"| {name} | {self.n} | {self.accuracy:.4f} | {self.auc:.4f} | {self.rec1:.4f} | {self.spec:.4f} | "
                f"{self.fpr:.4f} | {self.balanced_accuracy:.4f} |")


REPORT_HEADER = ("| predictor | held-out samples | Acc. | AUC | Rec1 | Spec. | FPR | BalAcc |\n"
                 "|---|---|---|---|---|---|---|---|")


def evaluate(scores: Array, y: NDArray[np.int64], threshold: float) -> Report:
    """Score = P(accepted); a score below ``threshold`` predicts rejection."""
    predicted = scores >= threshold
    accepted = y == 1
    rec1 = float(predicted[accepted].mean()) if accepted.any() else float("nan")
    spec = float((~predicted[~accepted]).mean()) if (~accepted).any() else float("nan")
    return Report(len(y), float((predicted == accepted).mean()), auc(scores, y), rec1, spec)


def auc(scores: Array, y: NDArray[np.int64]) -> float:
    """Area under the ROC curve: P(score of an accepted > score of a rejected), ties count half
    (the Mann-Whitney statistic from average ranks)."""
    pos, neg = int((y == 1).sum()), int((y == 0).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    ranks = avg_rank[inverse]
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def best_threshold(scores: Array, y: NDArray[np.int64]) -> float:
    """The cut on P(accepted) with the best balanced accuracy on these samples."""
    accepted = y == 1

    def balanced(t: float) -> float:
        predicted = scores >= t
        return float(predicted[accepted].mean() + (~predicted[~accepted]).mean()) / 2

    candidates = np.unique(np.quantile(scores, np.linspace(0.01, 0.99, 99)))
    return float(max(candidates, key=lambda t: balanced(float(t))))


def split(x: Array, y: NDArray[np.int64], test_fraction: float) -> tuple[Array, NDArray[np.int64],
                                                                       Array, NDArray[np.int64]]:
    """Train on the older samples, hold out the most recent ``test_fraction``: a predictor is
    used on tokens it has not seen, and neighbouring tokens of one request are alike, so a
    random split would let the held-out score peek at its training rows."""
    n_train = len(y) - round(len(y) * test_fraction)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]
