"""The committed demo model family under models/ loads, shares one tokenizer, and fits the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.models import load_model

torch.set_num_threads(1)
MODELS = Path(__file__).resolve().parents[2] / "models"
LIMIT_BYTES = 25 * 1000 * 1000

pytestmark = pytest.mark.skipif(
    not (MODELS / "target" / "config.json").exists(),
    reason="models/ has no demo family yet: run `make demo-models` to train it",
)


def _family() -> list[Path]:
    return [MODELS / "target", *sorted(p for p in MODELS.glob("draft*") if (p / "config.json").exists())]


def test_family_has_a_target_and_two_drafts() -> None:
    assert len(_family()) >= 3


def test_all_load_and_share_the_target_tokenizer() -> None:
    loaded = [load_model(p) for p in _family()]
    target = loaded[0]
    assert all(m.fingerprint == target.fingerprint for m in loaded)
    assert all(m.vocab_size == target.vocab_size for m in loaded)
    assert target.max_model_len >= 1024
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "def"}], tokenize=False,
                                                  add_generation_prompt=True)
    ids = torch.tensor([target.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    for m in loaded:
        assert m.model.config.head_dim >= 32
        with torch.no_grad():
            assert torch.isfinite(m.model(input_ids=ids).logits).all()


def test_weights_are_half_precision_safetensors() -> None:
    for path in _family():
        config = json.loads((path / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) in ("float16", "bfloat16")
        assert list(path.glob("*.safetensors")) and not list(path.glob("*.bin"))


def test_total_size_within_budget() -> None:
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file())
    assert total <= LIMIT_BYTES, f"models/ holds {total:,} bytes, over the {LIMIT_BYTES:,} budget"


def test_each_model_has_a_card_and_measurements_exist() -> None:
    for path in _family():
        card = path / "README.md"
        assert card.exists() and "Held-out loss" in card.read_text()
    report = json.loads((MODELS / "MEASUREMENTS.json").read_text())
    assert set(report["models"]) == {p.name for p in _family()}
