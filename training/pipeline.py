"""The draft pipeline as resumable stages; each skips itself when its output already exists.

target (fetched) -> prompts -> teacher answers (committed token ids) -> teacher top-k
distributions -> draft distillation -> export -> evaluation. Interrupting at any point and
re-running continues from the last checkpoint; with the committed answers present, a fresh
clone starts at the teacher's distributions.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shared.log import get_logger
from shared.model_import import KNOWN_MODELS, fetch_model
from shared.models import LoadedModel, load_model
from training.cards import write_cards
from training.config import Settings
from training.data import committed_path, load_answers, sequences, write_committed
from training.distill import AnswerBatches, distill_draft
from training.evaluate import evaluate_drafts, write_measurements
from training.export import export_model, parameter_count
from training.prompts import build_prompts, split_prompts
from training.teacher import TeacherPlan, generate_answers
from training.teacher_logits import Sequence, teacher_topk

log = get_logger("training")


def target_dir(settings: Settings) -> Path:
    """A known model's name is fetched (and converted) on first use; anything else is a directory."""
    if settings.target in KNOWN_MODELS:
        return fetch_model(settings.target, settings.fetch_dir)
    path = Path(settings.target)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"target {settings.target} is neither a known model "
                                f"({', '.join(KNOWN_MODELS)}) nor a model directory")
    return path


def teacher_answers(settings: Settings, target: LoadedModel, split: str) -> list[dict[str, Any]]:
    """The committed answers of ``split``, generating (and then committing) them if there are none."""
    name = Path(target.path).name
    committed = committed_path(settings.data_dir, name, split)
    if not committed.exists():
        prompts = split_prompts(build_prompts(settings.seed, settings.heldout_percent), split)
        plan = settings.teacher
        if split == "heldout":  # greedy answers to a fixed number of held-out prompts
            prompts = prompts[: settings.heldout_prompts]
            plan = TeacherPlan(plan.max_new_tokens, plan.batch, 0, plan.temperature, 10**12)
        out = settings.state_dir / "teacher" / f"{split}.jsonl"
        log.info("teacher answers", split=split, **generate_answers(target, prompts, out, plan))
        write_committed(load_answers(settings.data_dir, settings.state_dir, name, split), committed)
    return load_answers(settings.data_dir, settings.state_dir, name, split)


def prepare(settings: Settings) -> tuple[LoadedModel, list[Sequence], list[Sequence]]:
    """The target and its answers as training and held-out sequences."""
    target = load_model(target_dir(settings))
    prompts = build_prompts(settings.seed, settings.heldout_percent)
    train = sequences(teacher_answers(settings, target, "train"), prompts, target.tokenizer)
    held = sequences(teacher_answers(settings, target, "heldout"), prompts, target.tokenizer)
    overlap = {s.id for s in train} & {s.id for s in held}
    if overlap:
        raise ValueError(f"{len(overlap)} held-out prompts are in the training answers")
    return target, train, held


def run_all(settings: Settings, only: str = "") -> dict[str, Any]:
    """Distil (or resume) every draft (or just ``only``), export them to settings.out_dir, then measure."""
    torch.manual_seed(settings.seed)
    target, train, held = prepare(settings)
    started = time.monotonic()
    topk = teacher_topk(target, train, settings.state_dir / "topk", settings.topk)
    topk_s = time.monotonic() - started
    batches = AnswerBatches(train, topk, settings.seed, int(target.tokenizer.pad_token_id or 0))
    names = [only] if only else list(settings.drafts)
    summary: dict[str, Any] = {"seed": settings.seed, "torch_threads": torch.get_num_threads(),
                               "teacher_logits_seconds": round(topk_s, 1), "answers": len(train),
                               "answer_tokens": batches.tokens, "models": {}}
    for name in names:
        draft, result = distill_draft(name, settings, target.tokenizer, target.model, batches,
                                      settings.state_dir / name)
        log.info("draft distilled", **asdict(result))
        export_model(draft, target.tokenizer, settings.out_dir / name)
        summary["models"][name] = {"parameters": parameter_count(draft), "stage": asdict(result),
                                   "shape": asdict(settings.drafts[name])}
    path = settings.out_dir / "TRAINING.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    summary["models"] = {**previous.get("models", {}), **summary["models"]}
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return evaluate(settings, target, held)


def evaluate(settings: Settings, target: LoadedModel | None = None, held: list[Sequence] | None = None
             ) -> dict[str, Any]:
    """Measure the drafts in settings.out_dir; write MEASUREMENTS.json and the model cards."""
    if target is None or held is None:
        target, _, held = prepare(settings)
    drafts = sorted(p for p in settings.out_dir.glob("draft*") if (p / "config.json").exists())
    if not drafts:
        raise FileNotFoundError(f"no draft models in {settings.out_dir}; run `make demo-models` first")
    report = evaluate_drafts(Path(target.path), drafts, held)
    path = settings.out_dir / "TRAINING.json"
    report["training"] = json.loads(path.read_text()) if path.exists() else {}
    write_measurements(report, settings.out_dir)
    write_cards(settings.out_dir, report)
    return report


def evaluate_gguf(settings: Settings) -> dict[str, Any]:
    """Measure the target's GGUF copies (made beside it by fetch-model); write models/gguf/."""
    from shared.gguf_copies import WIDTHS, copy_path, write_cards
    from training.evaluate_gguf import evaluate_copies, write_report

    target, _, held = prepare(settings)
    target_dir = Path(target.path)
    report = evaluate_copies(target_dir, WIDTHS, held)
    write_report(report, settings.out_dir / "gguf" / "MEASUREMENTS.json")
    write_cards(target_dir, {w: copy_path(target_dir, w) for w in report["models"]}, force=True)
    return report
