"""``python -m training {all,eval}``: build the demo model family, or re-measure it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from shared.log import setup_logging
from training.config import Settings, toy_settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    p.add_argument("command", choices=["all", "eval", "distill"],
                   help="all: train/resume + export + measure; eval: measure; distill: one draft (--draft)")
    p.add_argument("--draft", default="", help="with distill: which draft to train (e.g. draft-small)")
    p.add_argument("--toy", action="store_true", help="tiny shapes and budgets (a smoke test of the pipeline)")
    p.add_argument("--state-dir", type=Path, default=Settings.state_dir, help="checkpoints and corpus cache")
    p.add_argument("--out-dir", type=Path, default=Settings.out_dir, help="where exported models go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for training (1: a second thread stalls badly when the CPU is shared)")
    p.add_argument("--target-steps", type=int, default=0, help="override the target's pretraining steps")
    p.add_argument("--distill-steps", type=int, default=0, help="override every draft's distillation steps")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    base = toy_settings(args.state_dir, args.out_dir) if args.toy else Settings(
        state_dir=args.state_dir, out_dir=args.out_dir)
    s = replace(base, seed=args.seed)
    if args.target_steps:
        s = replace(s, pretrain=replace(s.pretrain, steps=args.target_steps))
    if args.distill_steps:
        s = replace(s, distill={n: replace(st, steps=args.distill_steps) for n, st in s.distill.items()})
    return s


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("training", "INFO")
    torch.set_num_threads(args.threads)
    settings = settings_from(args)
    from training.evaluate import evaluate
    from training.pipeline import distill_only, run_all

    try:
        if args.command == "distill":
            distill_only(settings, args.draft)
            return 0
        report = run_all(settings) if args.command == "all" else evaluate(settings)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, m in report["models"].items():
        extra = ""
        if "vs_target" in m:
            code = m["vs_target"]["code"]
            extra = (f" agree={code['greedy_agreement']:.3f} accept_t1={code['acceptance_t1']:.3f}"
                     f" rounds_k4={code['rounds']['mean_accepted']:.2f} c={m['c']}")
        print(f"{name}: loss code={m['heldout_loss']['code']:.3f} docs={m['heldout_loss']['docs']:.3f} "
              f"ms/tok={m['ms_per_token']}{extra}")
    print(f"total bytes: {report['total_bytes']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
