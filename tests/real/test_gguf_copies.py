"""The target's GGUF copies that `specfleet fetch-model` leaves beside it: the shipped Q4_1 file as it
is, the other widths made by llama.cpp's own quantizer (the same bytes every time), each with the
target's token ids and a card with its measurements; and each drafts the target's own next token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.gguf_copies import MEASURED, SHIPPED, WIDTHS, copy_path, quantize
from shared.gguf_files import read_gguf, sha256_of
from shared.model_import import KNOWN_MODELS
from shared.models import load_model
from shared.runner import Segment
from shared.runner.llama import LlamaRunner
from tests.conftest import invariant_greedy

pytestmark = pytest.mark.real


def test_every_width_is_beside_the_target_with_its_ids_and_card(smollm2: Path) -> None:
    target = load_model(smollm2)
    assert sha256_of(copy_path(smollm2, SHIPPED)) == KNOWN_MODELS["smollm2-135m-instruct"].sha256
    measured = json.loads(MEASURED.read_text())["models"] if MEASURED.exists() else {}
    for width in WIDTHS:
        info = read_gguf(copy_path(smollm2, width))
        assert info.file_type == width and info.vocabulary.fingerprint == target.fingerprint
        card = copy_path(smollm2, width).with_suffix(".md").read_text()
        assert f"a {width} GGUF copy of smollm2-135m-instruct" in card
        if width in measured:  # the committed measurements: the card quotes them, and says of which file
            assert f"{measured[width]['greedy_agreement']:.3f}" in card
            assert ("this file" in card) == (measured[width]["sha256"] == sha256_of(copy_path(smollm2, width)))


def test_the_quantizer_makes_the_same_bytes_again(smollm2: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.gguf"
    quantize(copy_path(smollm2, SHIPPED), again, "Q4_0")
    assert sha256_of(again) == sha256_of(copy_path(smollm2, "Q4_0"))


@pytest.mark.parametrize("width", ["Q4_1", "Q8_0"])
def test_a_copy_predicts_the_targets_own_next_token_almost_always(smollm2: Path, width: str) -> None:
    """Teacher-forced on the target's greedy answer to a chat prompt (as the verifier computes it),
    the copy's argmax is the target's token at nearly every position."""
    target = load_model(smollm2)
    chat = [{"role": "user", "content": "Tell me about bees."}]
    prompt = list(target.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
    answer = invariant_greedy(target, prompt, 48)
    runner = LlamaRunner(read_gguf(copy_path(smollm2, width)), 64 << 20, threads=2)
    slot = runner.kv.allocate(len(prompt) + len(answer))
    assert slot is not None
    logits = runner.forward([Segment(slot, [*prompt, *answer[:-1]], len(prompt) - 1)])
    assert logits is not None and logits.shape[0] == len(answer)
    agree = sum(int(a) == b for a, b in zip(logits.argmax(-1).tolist(), answer, strict=True)) / len(answer)
    assert agree >= 0.85, agree


@pytest.mark.parametrize("width", [SHIPPED, "Q8_0"])
def test_the_real_copies_read_as_transformers_reads_them(smollm2: Path, width: str) -> None:
    """specfleet's GGUF reader (the drafters' and the import's) against transformers' own loader, on the
    real files (the shipped one, and the default fleet's other): the same config, weights, buffers and
    logits, bit for bit."""
    from shared.model_import import gguf_float_model
    from tests.unit.test_gguf_weights import assert_same_model, transformers_model

    path = copy_path(smollm2, width)
    assert_same_model(gguf_float_model(path), transformers_model(path))
