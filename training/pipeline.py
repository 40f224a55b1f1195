"""The whole pipeline as resumable stages: each one skips itself when its output already exists.

corpus -> tokenizer -> token streams -> target pretraining -> draft distillation -> export ->
evaluation. Interrupting at any point and re-running continues from the last checkpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shared.log import get_logger
from training.batches import WindowSampler
from training.config import Settings
from training.corpus import build_corpus
from training.distill import distill_draft
from training.evaluate import evaluate
from training.export import export_model, parameter_count
from training.tokenizer import encode_corpus, load_tokens, train_tokenizer
from training.train import pretrain_target

log = get_logger("training")


def _timed_json(path: Path, make: Any) -> Any:
    """Run make() once and cache its JSON-able result (with its wall time) at path."""
    if path.exists():
        return json.loads(path.read_text())["result"]
    t0 = time.monotonic()
    result = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"result": result, "seconds": round(time.monotonic() - t0, 1)}, indent=2))
    return result


def load_state_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def prepare_data(settings: Settings) -> tuple[Any, dict[str, int], WindowSampler]:
    """Corpus, tokenizer and token streams (each cached); returns the tokenizer, sizes and sampler."""
    state = settings.state_dir
    corpus = state / "corpus.jsonl"
    counts = _timed_json(state / "corpus.json", lambda: build_corpus(corpus, settings.heldout_percent))
    log.info("corpus ready", documents=counts)
    tok_dir = state / "tokenizer"
    _timed_json(state / "tokenizer.json", lambda: len(train_tokenizer(corpus, tok_dir, settings.vocab_size,
                                                                      settings.tokenizer_bytes)))
    tokenizer = load_state_tokenizer(tok_dir)
    sizes = _timed_json(state / "tokens.json", lambda: encode_corpus(corpus, tokenizer, state / "tokens"))
    log.info("tokens ready", tokens=sizes, vocab=len(tokenizer))
    sampler = WindowSampler(load_tokens(state / "tokens", "train", "code"),
                            load_tokens(state / "tokens", "train", "docs"),
                            settings.seq_len, settings.docs_weight, settings.seed)
    return tokenizer, sizes, sampler


def distill_only(settings: Settings, name: str) -> None:
    """Distil one draft (training the target first if needed): lets drafts train in parallel processes."""
    if name not in settings.drafts:
        raise ValueError(f"unknown draft {name!r}; choose from {sorted(settings.drafts)}")
    torch.manual_seed(settings.seed)
    tokenizer, _, sampler = prepare_data(settings)
    target, _ = pretrain_target(settings, tokenizer, sampler, settings.state_dir / "target")
    _, result = distill_draft(name, settings, tokenizer, target, sampler, settings.state_dir / name)
    log.info("draft distilled", **asdict(result))


def run_all(settings: Settings) -> dict[str, Any]:
    """Train (or resume) everything, export to settings.out_dir, then measure."""
    torch.manual_seed(settings.seed)
    tokenizer, sizes, sampler = prepare_data(settings)
    target, target_result = pretrain_target(settings, tokenizer, sampler, settings.state_dir / "target")
    log.info("target trained", **asdict(target_result))
    trained: dict[str, tuple[Any, Any]] = {"target": (target, target_result)}
    for name in settings.drafts:
        draft, result = distill_draft(name, settings, tokenizer, target, sampler, settings.state_dir / name)
        log.info("draft distilled", **asdict(result))
        trained[name] = (draft, result)
    prep = sum(json.loads((settings.state_dir / f"{n}.json").read_text())["seconds"]
               for n in ("corpus", "tokenizer", "tokens"))
    summary: dict[str, Any] = {
        "seed": settings.seed,
        "torch_threads": torch.get_num_threads(),
        "data_prep_seconds": round(prep, 1),
        "train_minutes_total": round((prep + sum(r.seconds for _, r in trained.values())) / 60, 1),
        "corpus": {"heldout_percent": settings.heldout_percent, "tokens": sizes, "seq_len": settings.seq_len,
                   "docs_weight": settings.docs_weight},
        "models": {},
    }
    for name, (model, result) in trained.items():
        export_model(model, tokenizer, settings.out_dir / name)
        summary["models"][name] = {"parameters": parameter_count(model), "stage": asdict(result)}
    (settings.out_dir / "TRAINING.json").write_text(json.dumps(summary, indent=2) + "\n")
    return evaluate(settings)
