"""How long one verifier forward takes, from the shapes of its segments (WISP's estimator).

WISP (wisp.txt §4.4, eq. 19) models a batch's verification time as additive in three counts
over its sessions ``i``, each feeding ``L_new,i`` tokens after ``L_cached,i`` cached rows
(``L_total,i = L_cached,i + L_new,i``):

    T = a·Σ L_new  +  b·Σ (L_total·L_new)  +  c·Σ L_cached  +  d

``a`` prices the linear layers (every fed token goes through them), ``b`` the query-key
interactions of attention (quadratic for a cold prefill, linear in the prefix for a warm
round of a few drafts), ``c`` reading the cached keys and values, ``d`` the fixed cost of a
step. The same step-time model serves SmartSpec's goodput-driven batch sizing (smartspec.txt
§4, its batch execution time T_fwd) and AdaSpec's trim of draft lengths, so they all share
this module.

The coefficients come from the offline profiler (``python -m services.verifier.profile``, a
JSON file read with :meth:`StepTimeEstimator.load`) or, without one, from the verifier's own
calibration at start-up (a few dozen timed forwards, :func:`services.verifier.profile.calibrate`),
and are refined online from measured steps (:meth:`StepTimeEstimator.observe`).
:data:`DEFAULT_COEF` is only a starting point where neither ran. Every time is in seconds.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shared.target_only_cost import forward_seconds

#: names of the fitted columns, in coefficient order (the last is the constant)
FEATURES = ("sum_new", "sum_total_x_new", "sum_cached", "const")
#: un-profiled CPU guess, only a starting point: 50 µs per fed token, 5 ns per query-key
#: interaction, 20 ns per cached row read, 2 ms per step. Profile the real machine instead.
DEFAULT_COEF: tuple[float, float, float, float] = (50e-6, 5e-9, 20e-9, 2e-3)
#: predictions never go below this (seconds): a forward always costs something
MIN_SECONDS = 1e-5
#: fewest distinct feature rows the online refit needs before it trusts a fit
MIN_DISTINCT = 8
#: smallest singular value, relative to the largest, of the column-scaled design for a well-posed fit
RANK_RTOL = 1e-6

Coef = tuple[float, float, float, float]


@dataclass(frozen=True)
class SegmentShape:
    new: int  # L_new: tokens fed to the model for this session in the step (committed tail + drafts)
    cached: int  # L_cached: KV rows the session already holds before the step

    @property
    def total(self) -> int:
        return self.cached + self.new  # L_total


class StepTimeModel(Protocol):
    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        """Seconds for one forward over these segments."""
        ...


Sample = tuple[Sequence[SegmentShape], float]


@dataclass(frozen=True)
class FitReport:
    r2: float  # coefficient of determination of the predictions
    mape: float  # mean absolute percentage error, as a fraction (0.05 = 5 %)
    n: int  # samples evaluated


def features(shapes: Sequence[SegmentShape]) -> tuple[float, float, float]:
    """``(Σ L_new, Σ L_total·L_new, Σ L_cached)`` of one batch."""
    new = total_new = cached = 0
    for s in shapes:
        new += s.new
        total_new += (s.cached + s.new) * s.new
        cached += s.cached
    return float(new), float(total_new), float(cached)


def _design(rows: Sequence[tuple[float, float, float]]) -> np.ndarray:
    x = np.ones((len(rows), 4))
    if rows:
        x[:, :3] = np.asarray(rows, dtype=float)
    return x


def _scaled(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns divided by their largest magnitude (the features span many orders of magnitude)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    return x / scale, scale


def _well_posed(x: np.ndarray, min_distinct: int = 4) -> bool:
    """Whether the rows (at least ``min_distinct`` of them distinct) determine all four
    coefficients: full column rank, numerically."""
    if len(x) < min_distinct or len(np.unique(x, axis=0)) < min_distinct:
        return False
    sv = np.linalg.svd(_scaled(x)[0], compute_uv=False)
    return bool(sv[-1] > RANK_RTOL * sv[0])


def _non_negative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (each is a cost): refit without the most
    negative column until none is negative, a small active-set approximation of NNLS."""
    xs, scale = _scaled(x)
    active = [True] * x.shape[1]
    w = np.zeros(x.shape[1])
    while any(active):
        cols = np.flatnonzero(active)
        w = np.zeros(x.shape[1])
        w[cols] = np.linalg.lstsq(xs[:, cols], y, rcond=None)[0]
        if (w >= 0).all():
            break
        active[int(np.argmin(w))] = False
    return np.asarray(w / scale)


def _solve(x: np.ndarray, y: np.ndarray) -> Coef:
    coef = _non_negative(x, y)
    return float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3])


def fit(samples: Sequence[Sample]) -> Coef:
    """Least-squares ``(a, b, c, d)`` of eq. 19 from measured ``(shapes, seconds)`` batches.

    Raises ValueError when the batches cannot determine all four coefficients (too few, or
    collinear shapes: e.g. every batch alike)."""
    x = _design([features(shapes) for shapes, _ in samples])
    if not _well_posed(x):
        raise ValueError(
            f"{len(samples)} batches do not determine the 4 coefficients of eq. 19: profile more varied "
            "batch shapes (sizes, contexts and new-token counts)"
        )
    return _solve(x, np.asarray([t for _, t in samples], dtype=float))


def evaluate(model: StepTimeModel, samples: Sequence[Sample]) -> FitReport:
    """R² and MAPE of ``model``'s predictions against measured ``(shapes, seconds)`` batches."""
    if not samples:
        raise ValueError("no samples to evaluate")
    y = np.asarray([t for _, t in samples], dtype=float)
    p = np.asarray([model.predict(shapes) for shapes, _ in samples], dtype=float)
    ss_res = float(((y - p) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res <= 1e-24 else 0.0)
    mape = float((np.abs(y - p) / np.maximum(np.abs(y), 1e-12)).mean())
    return FitReport(r2=r2, mape=mape, n=len(samples))


class RecentLine:
    """Least-squares line ``y = e0 + e1·x`` through the last ``window`` points, refitted every
    ``refit_every`` of them (and at each of the first ``refit_every``). Both coefficients are
    costs, kept non-negative; while every point has the same x the line is flat (e1 = 0)."""

    def __init__(self, window: int = 256, refit_every: int = 16) -> None:
        if window < 2 or refit_every < 1:
            raise ValueError(f"need window >= 2 and refit_every >= 1, got {window} and {refit_every}")
        self.points: deque[tuple[float, float]] = deque(maxlen=window)
        self.refit_every, self._since = refit_every, 0
        self.e0, self.e1 = 0.0, 0.0

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or y < 0:
            return
        self.points.append((x, y))
        self._since += 1
        if self._since >= self.refit_every or len(self.points) < self.refit_every:
            self._since = 0
            self._refit()

    def _refit(self) -> None:
        n = len(self.points)
        mean_x = sum(x for x, _ in self.points) / n
        mean_y = sum(y for _, y in self.points) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.points)
        cov = sum((x - mean_x) * (y - mean_y) for x, y in self.points)
        self.e1 = max(0.0, cov / var) if var > 0 else 0.0
        self.e0 = max(0.0, mean_y - self.e1 * mean_x)

    def predict(self, x: float) -> float:
        return self.e0 + self.e1 * x


class TargetOnlyCost:
    """Forwards that feed every session one token, as target-only decoding runs them: for each
    session count seen, a :class:`RecentLine` of seconds against the sessions' mean cached rows
    (the last ``window`` such forwards of that count). Eq. 19 prices these poorly on a memory-bound
    CPU, where a 5-token session costs what a 1-token one does and one line through both misses
    each; the dashboard's speedup estimate prices target-only with :meth:`table` instead
    (:func:`shared.target_only_cost.forward_seconds`)."""

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._lines: dict[int, RecentLine] = {}

    def observe(self, shapes: Sequence[SegmentShape], seconds: float) -> None:
        """Record one forward if it fed every session one token (a prefill chunk feeds more)."""
        if not shapes or any(s.new != 1 for s in shapes):
            return
        line = self._lines.setdefault(len(shapes), RecentLine(self.window, refit_every=4))
        line.observe(sum(s.cached for s in shapes) / len(shapes), seconds)

    def table(self) -> list[tuple[int, float, float]]:
        """``(sessions, seconds at no context, seconds per cached row)`` for each count seen."""
        return [(b, line.e0, line.e1) for b, line in sorted(self._lines.items()) if line.points]

    def predict(self, sessions: float, cached_per_session: float) -> float | None:
        """Seconds of such a forward; None before any was seen."""
        return forward_seconds(self.table(), sessions, cached_per_session)


def overhead_line() -> RecentLine:
    """The line of the verifier's busy seconds between forwards against a step's sessions."""
    return RecentLine(window=512, refit_every=32)


class StepTimeEstimator:
    """Eq. 19 with its coefficients, refined online from measured steps (a :class:`StepTimeModel`).

    ``overhead`` is the verifier's busy time outside the forward, per step, as a line in the
    step's sessions (judging, committing, publishing, reading the next drafts, scheduling): fed by
    the engine core, it is what a policy adds to eq. 19 to price a step's whole period."""

    def __init__(self, coef: Coef = DEFAULT_COEF, window: int = 512, refit_every: int = 64) -> None:
        if window < MIN_DISTINCT or refit_every < 1:
            raise ValueError(f"need window >= {MIN_DISTINCT} and refit_every >= 1, got {window} and {refit_every}")
        self._set(coef)
        self._fitted = False
        self._window: deque[tuple[tuple[float, float, float], float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_refit = 0
        self.report: FitReport | None = None  # the profile's held-out report, when loaded from a file
        self.overhead = overhead_line()  # busy seconds between forwards, by sessions
        self.target_only = TargetOnlyCost()  # forwards feeding every session one token

    def _set(self, coef: Sequence[float]) -> None:
        a, b, c, d = (float(v) for v in coef)
        if not all(math.isfinite(v) for v in (a, b, c, d)):
            raise ValueError(f"coefficients must be finite, got {tuple(coef)}")
        self._a, self._b, self._c, self._d = a, b, c, d

    @property
    def coef(self) -> Coef:
        return self._a, self._b, self._c, self._d

    @property
    def fitted(self) -> bool:
        """True once the coefficients came from a fit (online or a profile file)."""
        return self._fitted

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        return self.predict_sums(*features(shapes))

    def predict_sums(self, new: float, total_new: float, cached: float) -> float:
        """Eq. 19 from pre-summed features (O(1): for schedulers growing a batch incrementally)."""
        t = self._a * new + self._b * total_new + self._c * cached + self._d
        return t if t > MIN_SECONDS else MIN_SECONDS

    def observe(self, shapes: Sequence[SegmentShape], seconds: float) -> None:
        """Record one measured forward; every ``refit_every`` records, refit on the last ``window``
        ones if they determine all four coefficients (otherwise keep the current ones)."""
        if not (seconds > 0 and math.isfinite(seconds)) or not shapes:
            return
        self.target_only.observe(shapes, seconds)
        self._window.append((features(shapes), seconds))
        self._since_refit += 1
        if self._since_refit >= self._refit_every:
            self._since_refit = 0
            self._refit()

    def seed(self, samples: Sequence[Sample]) -> None:
        """Fit on measured ``(shapes, seconds)`` forwards (the start-up calibration) and keep them
        in the online window, so refits see their variety until real steps have pushed them out.
        ValueError when they do not determine the coefficients (as :func:`fit`)."""
        self._set(fit(samples))
        self._fitted = True
        for shapes, seconds in samples:
            self._window.append((features(shapes), seconds))
            self.target_only.observe(shapes, seconds)

    def _refit(self) -> None:
        x = _design([f for f, _ in self._window])
        if not _well_posed(x, MIN_DISTINCT):
            return
        self._set(_solve(x, np.asarray([t for _, t in self._window], dtype=float)))
        self._fitted = True

    def save(
        self, path: str | Path, report: FitReport | None = None, model: str = "", extra: dict[str, Any] | None = None
    ) -> None:
        """Write the coefficients as JSON, with the fit's quality (``report``) and provenance."""
        report = report or self.report
        doc: dict[str, Any] = {
            "estimator": "wisp-eq19",
            "features": list(FEATURES),
            "coef": list(self.coef),
            "units": "seconds",
            "r2": report.r2 if report else None,
            "mape": report.mape if report else None,
            "n": report.n if report else len(self._window),
            "model": model,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **(extra or {}),
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeEstimator:
        """Read a file written by :meth:`save`; ValueError (saying what is wrong) if it is not one."""
        try:
            doc = json.loads(Path(path).read_text())
            names, coef = doc["features"], doc["coef"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path} is not a verifier step-time profile ({exc}); write one with `make profile-verifier`"
            ) from None
        if list(names) != list(FEATURES) or len(coef) != len(FEATURES):
            raise ValueError(f"{path} has features {names}, expected {list(FEATURES)}: re-run `make profile-verifier`")
        a, b, c, d = (float(v) for v in coef)
        est = cls((a, b, c, d))
        est._fitted = True
        if doc.get("r2") is not None and doc.get("mape") is not None:
            est.report = FitReport(r2=float(doc["r2"]), mape=float(doc["mape"]), n=int(doc.get("n") or 0))
        return est
