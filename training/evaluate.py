"""Measure the exported family (the fp16 weights that ship) and write MEASUREMENTS.json + model cards.

It loads models the way the services do (``shared.models.load_model``), so the recorded numbers
describe exactly what is committed under ``models/``. Held-out text is re-encoded with the
target's tokenizer from the corpus, so ``make demo-models-eval`` works without training state.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from shared.models import LoadedModel, load_model
from training.batches import eval_windows
from training.cards import write_cards
from training.config import Settings
from training.corpus import DOMAINS, build_corpus, read_corpus
from training.export import dir_bytes, parameter_count
from training.measure import decode_costs, heldout_loss, pair_stats, spec_round_stats

PROMPT_TOKENS = 64
COST_TOKENS, COST_RUNS, COST_THREADS = 128, 7, (1, 2)
ROUND_K = 4


def family_dirs(out_dir: Path) -> list[Path]:
    """target first, then every draft* directory, sorted."""
    target = out_dir / "target"
    if not (target / "config.json").exists():
        raise FileNotFoundError(f"{target} has no model; run `make demo-models` first")
    return [target, *sorted(p for p in out_dir.glob("draft*") if (p / "config.json").exists())]


def heldout_streams(settings: Settings, tokenizer: Any) -> dict[str, np.ndarray]:
    corpus = settings.state_dir / "corpus.jsonl"
    if not corpus.exists():
        build_corpus(corpus, settings.heldout_percent)
    eos = int(tokenizer.eos_token_id)
    streams = {}
    for domain in DOMAINS:
        ids: list[int] = []
        for row in read_corpus(corpus, split="heldout", domain=domain):
            ids.extend(tokenizer(row["text"], add_special_tokens=False)["input_ids"])
            ids.append(eos)
        streams[domain] = np.asarray(ids, dtype=np.int64)
    return streams


def _model_entry(lm: LoadedModel, windows: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    cfg = lm.model.config
    return {
        "parameters": parameter_count(lm.model),
        "weight_bytes": sum(p.stat().st_size for p in path.glob("*.safetensors")),
        "dir_bytes": dir_bytes(path),
        "shape": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "intermediate": cfg.intermediate_size,
                  "max_positions": cfg.max_position_embeddings},
        "heldout_loss": {d: round(heldout_loss(lm.model, w), 4) for d, w in windows.items()},
    }


def _pair_entry(target: LoadedModel, draft: LoadedModel, windows: dict[str, torch.Tensor],
                prompts: dict[str, torch.Tensor], new_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for domain, w in windows.items():
        stats = asdict(pair_stats(target.model, draft.model, w))
        stats["rounds"] = spec_round_stats(target.model, draft.model, prompts[domain], new_tokens, ROUND_K)
        out[domain] = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}
    return out


def _add_costs(entries: dict[str, Any], models: dict[str, LoadedModel], prompt: torch.Tensor) -> None:
    """ms/token of every model at each thread count, and c = draft / target for each draft."""
    nets = {name: lm.model for name, lm in models.items()}
    for threads in tqdm(COST_THREADS, desc="decode cost"):
        costs = decode_costs(nets, prompt, COST_TOKENS, COST_RUNS, threads)
        for name, ms in costs.items():
            entries[name].setdefault("ms_per_token", {})[str(threads)] = round(ms, 3)
            if name != "target":
                entries[name].setdefault("c", {})[str(threads)] = round(ms / costs["target"], 3)


def evaluate(settings: Settings) -> dict[str, Any]:
    """Measure every model under settings.out_dir; write MEASUREMENTS.json and the model cards."""
    started = time.monotonic()
    dirs = family_dirs(settings.out_dir)
    models = {p.name: load_model(p) for p in tqdm(dirs, desc="load models")}
    target = models["target"]
    mismatched = [n for n, m in models.items() if m.fingerprint != target.fingerprint]
    if mismatched:
        raise ValueError(f"{mismatched} do not share the target's tokenizer; retrain with `make demo-models`")
    streams = heldout_streams(settings, target.tokenizer)
    windows = {d: eval_windows(s, settings.eval_windows, settings.seq_len) for d, s in streams.items()}
    prompts = {d: eval_windows(s, settings.spec_prompts, PROMPT_TOKENS - 1) for d, s in streams.items()}
    entries: dict[str, Any] = {}
    for name, lm in tqdm(models.items(), desc="measure"):
        entries[name] = _model_entry(lm, windows, settings.out_dir / name)
        if name != "target":
            entries[name]["vs_target"] = _pair_entry(target, lm, windows, prompts, settings.spec_new_tokens)
    _add_costs(entries, models, prompts["code"][:1, :8])
    report = _assemble(settings, target, entries, streams)
    report["eval_seconds"] = round(time.monotonic() - started, 1)
    (settings.out_dir / "MEASUREMENTS.json").write_text(json.dumps(report, indent=2) + "\n")
    write_cards(settings.out_dir, report)
    return report


def _assemble(settings: Settings, target: LoadedModel, entries: dict[str, Any], streams: dict[str, np.ndarray]
              ) -> dict[str, Any]:
    training_path = settings.out_dir / "TRAINING.json"
    training = json.loads(training_path.read_text()) if training_path.exists() else {}
    for name, entry in entries.items():
        entry["training"] = training.get("models", {}).get(name, {})
    corpus = training.get("corpus", {"heldout_percent": settings.heldout_percent, "tokens": {}})
    corpus["heldout_eval_tokens"] = {d: int(s.size) for d, s in streams.items()}
    return {
        "method": {
            "greedy_agreement": "teacher-forced on held-out windows: draft argmax == target argmax",
            "acceptance_t1": "mean over positions of sum_x min(p(x), q(x)) = 1 - TV(p, q)",
            "rounds": f"exact greedy speculative rounds, k={ROUND_K}, on the target's greedy continuations "
                      f"({settings.spec_new_tokens} tokens) of {PROMPT_TOKENS}-token held-out prompts",
            "cost": f"batch 1, KV cache, {COST_TOKENS} greedy tokens after an 8-token prompt, "
                    f"median of {COST_RUNS} runs, fp32 on CPU ({platform.processor() or platform.machine()})",
        },
        "windows": {"count_per_domain": settings.eval_windows, "seq_len": settings.seq_len},
        "cost": {"tokens": COST_TOKENS, "runs": COST_RUNS, "threads": list(COST_THREADS)},
        "tokenizer": {"vocab_size": len(target.tokenizer), "fingerprint": target.fingerprint},
        "corpus": corpus,
        "training": {k: training.get(k) for k in ("seed", "torch_threads", "data_prep_seconds",
                                                  "train_minutes_total")},
        "total_bytes": sum(dir_bytes(settings.out_dir / n) for n in entries),
        "models": entries,
    }
