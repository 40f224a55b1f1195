"""``specfleet wisp-train``: train WISP's rejection predictor from a drafter's labelled tokens.

    specfleet drafter --controller wisp --wisp-samples samples.csv ...   # collect from live verdicts
    specfleet wisp-train samples.csv --out wisp.json                     # train, report on a held-out split
    specfleet drafter --controller wisp --wisp-model wisp.json ...       # serve with it

Prints the shape of WISP's Table 4 on the held-out split, for the MLP beside two baselines
measured on the same samples: the confidence threshold rule (``--controller threshold``) and
"always accept" (the fixed-k baseline, which never predicts a rejection).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from services.drafter.control.rejection_predictor import (
    FEATURES,
    REPORT_HEADER,
    RejectionMLP,
    Report,
    TrainSettings,
    evaluate,
    split,
    train,
)
from services.drafter.control.threshold import DEFAULT_THRESHOLD


def load_samples(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Rows of FEATURES and the accepted label; ValueError saying what is wrong with the file."""
    try:
        with path.open() as f:
            header = f.readline().strip().split(",")
            data = np.loadtxt(f, delimiter=",", ndmin=2)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read samples from {path}: {exc}") from exc
    if header != [*FEATURES, "accepted"]:
        raise ValueError(f"{path} has columns {header}; expected {[*FEATURES, 'accepted']} "
                         "(written by `specfleet drafter --controller wisp --wisp-samples FILE`)")
    if data.size == 0:
        raise ValueError(f"{path} holds no samples yet; serve some requests with --wisp-samples first")
    return data[:, :-1], data[:, -1].astype(np.int64)


def report(x: np.ndarray, y: np.ndarray, test_fraction: float, settings: TrainSettings) -> tuple[str, RejectionMLP]:
    """Train on a split and evaluate on the rest: (the report table, the model trained on it)."""
    x_train, y_train, x_test, y_test = split(x, y, test_fraction)
    if len(np.unique(y_test)) < 2:
        raise ValueError(f"the held-out split ({len(y_test)} samples) holds one class only; collect more samples")
    model = train(x_train, y_train, settings)
    top1 = x_test[:, FEATURES.index("top1_prob")]
    rows: list[tuple[str, Report]] = [
        ("MLP (3-layer)", evaluate(model.accept_prob(x_test), y_test, model.threshold)),
        (f"threshold (top-1 < {DEFAULT_THRESHOLD})", evaluate(top1, y_test, DEFAULT_THRESHOLD)),
        ("always accept (fixed k)", evaluate(np.ones(len(y_test)), y_test, 0.5)),
    ]
    accepted = float(y.mean())
    lines = [f"{len(y)} labelled tokens ({accepted:.1%} accepted); trained on {len(y_train)}, held out "
             f"{len(y_test)}; MLP threshold P(accepted) < {model.threshold:.3f}", "", REPORT_HEADER]
    lines += [r.row(name) for name, r in rows]
    return "\n".join(lines), model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specfleet wisp-train", description=__doc__.splitlines()[0])
    p.add_argument("samples", help="CSV written by a drafter's --wisp-samples")
    p.add_argument("--out", default="wisp.json", help="where to write the predictor (default wisp.json)")
    p.add_argument("--test-fraction", type=float, default=0.2, help="held-out share for the report (default 0.2)")
    p.add_argument("--report", default="", help="also write the report table (markdown) to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0.0 < args.test_fraction < 1.0:
        p.error(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    try:
        x, y = load_samples(Path(args.samples))
        text, _ = report(x, y, args.test_fraction, TrainSettings(seed=args.seed))
        final = train(x, y, TrainSettings(seed=args.seed))  # served: trained on every sample
    except ValueError as exc:
        print(f"specfleet wisp-train: error: {exc}", file=sys.stderr)
        return 2
    final.save(Path(args.out))
    print(text)
    print(f"\nwrote {args.out} (trained on all {len(y)} samples); serve it with "
          f"`specfleet drafter --controller wisp --wisp-model {args.out}`")
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
