"""Model cards (README.md per model directory) rendered from the measurements.

Cards are generated, never hand-edited, so the numbers in them are always the ones in
``models/MEASUREMENTS.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _training_lines(train: dict[str, Any]) -> list[str]:
    stage = train.get("stage", {})
    what = "cross-entropy" if stage.get("name") == "target" else "KL to the target"
    minutes = stage.get("seconds", 0.0) / 60
    early = " (stopped early by the stage's wall-clock guard)" if stage.get("stopped_early") else ""
    return [
        f"- Trained {stage.get('steps')} / {stage.get('planned_steps')} steps, "
        f"{stage.get('tokens', 0) / 1e6:.2f} M tokens, {minutes:.1f} min on a 2-core CPU{early}.",
        f"- Final training loss ({what}, EMA): {_fmt(stage.get('final_loss'))}.",
    ]


def render_card(name: str, report: dict[str, Any]) -> str:
    model = report["models"][name]
    shape = model["shape"]
    is_target = name == "target"
    lines = [
        f"# specfleet demo model: {name}",
        "",
        ("The target model of specfleet's demo family" if is_target else
         "A draft model of specfleet's demo family, distilled from `target` (KL on the target's logits)")
        + ": a Llama-style causal LM made by `make demo-models` (the `training/` package) from scratch.",
        "It is a toy for exercising speculative decoding on a CPU, not a useful assistant.",
        "",
        "## Architecture",
        f"- {model['parameters'] / 1e6:.2f} M parameters, {shape['layers']} layers, hidden {shape['hidden']}, "
        f"{shape['heads']} heads (head_dim {shape['hidden'] // shape['heads']}), {shape['kv_heads']} KV heads, "
        f"MLP {shape['intermediate']}, max positions {shape['max_positions']}, tied embeddings.",
        f"- Weights: fp16 safetensors, {model['weight_bytes'] / 1e6:.2f} MB.",
        f"- Tokenizer: byte-level BPE, {report['tokenizer']['vocab_size']} tokens, shared by the whole family "
        f"(fingerprint `{report['tokenizer']['fingerprint']}`), with specfleet's chat template.",
        "",
        "## Corpus",
        "Python 3.11 standard-library source (test suites excluded) and the English language reference "
        "(`pydoc_data/topics.py`, one document per topic); "
        f"{report['corpus']['heldout_percent']} % of files held out by a hash of the file name.",
        f"Token counts: {', '.join(f'{k} {v:,}' for k, v in report['corpus']['tokens'].items())}.",
        "",
        "## Training",
        *_training_lines(model["training"]),
        f"- The whole family (data prep, target, every draft) took {report['training'].get('train_minutes_total')}"
        f" min of training at {report['training'].get('torch_threads')} torch thread(s), seed "
        f"{report['training'].get('seed')}.",
        "",
        "## Measured (held-out text)",
        f"- Held-out loss (nats/token): code {_fmt(model['heldout_loss']['code'])}, "
        f"docs {_fmt(model['heldout_loss']['docs'])}.",
        f"- Decode cost (batch 1, KV cache, {report['cost']['tokens']} tokens, median of {report['cost']['runs']}): "
        + ", ".join(f"{_fmt(v, 2)} ms/token at {t} thread(s)" for t, v in model["ms_per_token"].items()) + ".",
    ]
    if not is_target:
        lines += _pair_lines(model)
    lines += ["", "Numbers come from `models/MEASUREMENTS.json` (`make demo-models-eval` re-measures)."]
    return "\n".join(lines) + "\n"


def _pair_lines(model: dict[str, Any]) -> list[str]:
    vs = model["vs_target"]
    out = []
    for domain in ("code", "docs"):
        d = vs[domain]
        out.append(
            f"- vs target on held-out {domain}: greedy agreement {_fmt(d['greedy_agreement'])}, acceptance at "
            f"temperature 1 {_fmt(d['acceptance_t1'])}, mean accepted per round at k={d['rounds']['k']} "
            f"{_fmt(d['rounds']['mean_accepted'], 2)} (exact greedy speculative rounds on the target's own "
            "continuations of held-out prompts)."
        )
    out.append(
        "- Cost ratio c = draft / target ms per token: "
        + ", ".join(f"{_fmt(v, 2)} at {t} thread(s)" for t, v in model["c"].items()) + "."
    )
    return out


def write_cards(out_dir: Path, report: dict[str, Any]) -> None:
    for name in report["models"]:
        (out_dir / name / "README.md").write_text(render_card(name, report), encoding="utf-8")
