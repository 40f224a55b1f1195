"""``python -m training {all,eval}``: distil the draft models from the target, or re-measure them."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from shared.log import setup_logging
from shared.models import ModelLoadError
from training.config import Settings, toy_settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    p.add_argument("command", choices=["all", "eval", "eval-gguf", "distill"],
                   help="all: answers, distil, export, measure (resumable); eval: measure models/; eval-gguf: measure "
                        "the target's GGUF copies (models/gguf/); distill: one draft (--draft), then measure")
    p.add_argument("--draft", default="", help="with distill: which draft to train (draft-large or draft-small)")
    p.add_argument("--target", default=Settings.target,
                   help="the teacher: a known model's name (fetched on first use) or a model directory")
    p.add_argument("--toy", action="store_true", help="tiny shapes and budgets (a smoke test of the pipeline)")
    p.add_argument("--state-dir", type=Path, default=Settings.state_dir, help="checkpoints and caches")
    p.add_argument("--out-dir", type=Path, default=Settings.out_dir, help="where exported drafts go")
    p.add_argument("--data-dir", type=Path, default=Settings.data_dir, help="the committed teacher answers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--distill-steps", type=int, default=0, help="override every draft's distillation steps")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if args.toy:
        base = toy_settings(args.target, args.state_dir, args.out_dir, args.data_dir)
    else:
        base = Settings(target=args.target, state_dir=args.state_dir, out_dir=args.out_dir, data_dir=args.data_dir)
    s = replace(base, seed=args.seed)
    if args.distill_steps:
        s = replace(s, distill={n: replace(st, steps=args.distill_steps) for n, st in s.distill.items()})
    return s


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("training", "INFO")
    torch.set_num_threads(args.threads)
    settings = settings_from(args)
    from training.pipeline import evaluate, evaluate_gguf, run_all

    if args.command == "distill" and args.draft not in settings.drafts:
        print(f"error: --draft must be one of {', '.join(settings.drafts)}", file=sys.stderr)
        return 2
    try:
        if args.command == "eval-gguf":
            report = evaluate_gguf(settings)
        else:
            report = evaluate(settings) if args.command == "eval" else run_all(settings, args.draft)
    except (FileNotFoundError, ValueError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target = report["target"]
    print(f"target {target['name']}: {target['step_ms']:.2f} ms/step ({target['dtype']})")
    for name, m in report["models"].items():
        print(f"{name}: agreement {m['greedy_agreement']:.3f}, accept_t1 {m['accept_t1']:.3f}, accepted/round(k=4) "
              f"{m['mean_accepted_k4']:.2f}, step {m['step_ms']:.2f} ms = {m['step_ratio']:.3f}x, "
              f"{m.get('weight_bytes', m.get('bytes', 0)) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
