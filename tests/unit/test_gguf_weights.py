"""specfleet's GGUF reader gives transformers' GGUF loader's model, bit for bit, in a fraction of the time.

The tiny target is written as GGUF files in float32, float16 and Q4_1 (``shared.gguf_write``); each is
read by ``shared.gguf_weights`` and by transformers' ``from_pretrained(..., gguf_file=...)``, and the
two must agree on the config, the generation config, every weight and buffer, and the logits. The
real model's Q4_1 file is checked the same way in tests/real/test_gguf_copies.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from shared.gguf_weights import _unpermute, gguf_config
from shared.gguf_write import permute_rotary, write_llama_gguf
from shared.model_import import ImportModelError, gguf_float_model


def transformers_model(path: Path) -> Any:
    """The model as transformers' own GGUF loader gives it, copied into a plain model (as specfleet
    imported GGUF files before it read them itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, gguf_file=path.name,
                                                  local_files_only=True)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    return plain.eval()


def assert_same_model(ours: Any, theirs: Any) -> None:
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    buffers, expected = dict(ours.named_buffers()), dict(theirs.named_buffers())
    assert buffers.keys() == expected.keys() and all(torch.equal(buffers[k], expected[k]) for k in buffers)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == theirs.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 9, 40, 77, 3, 120]])
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q4_1"])
def test_the_model_is_transformers_bit_for_bit(tiny_models: dict[str, Path], tmp_path: Path, dtype: str) -> None:
    path = write_llama_gguf(tiny_models["target"], tmp_path / f"target-{dtype}.gguf", dtype=dtype)
    assert_same_model(gguf_float_model(path), transformers_model(path))


@pytest.mark.parametrize(("heads", "rows", "cols"), [(1, 4, 3), (2, 8, 5), (3, 24, 2), (4, 64, 1)])
def test_unpermute_inverts_the_writers_rotary_permutation(heads: int, rows: int, cols: int) -> None:
    weight = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    assert np.array_equal(_unpermute(permute_rotary(weight, heads), heads), weight)
    assert not np.array_equal(permute_rotary(weight, heads), weight)


@pytest.mark.parametrize(("fields", "tensors", "expected"), [
    ({"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64},
     {"token_embd.weight"}, {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                             "tie_word_embeddings": True}),
    ({"general.architecture": "llama", "general.name": "mistral", "llama.rope.freq_base": 1e6},
     {"output.weight"}, {"model_type": "mistral", "_model_name_or_path": "mistral", "rope_theta": 1e6,
                         "tie_word_embeddings": False}),
    ({"general.architecture": "qwen2", "qwen2.rope.dimension_count": 64, "tokenizer.ggml.tokens": ["a", "b"]},
     set(), {"model_type": "qwen2", "vocab_size": 2, "tie_word_embeddings": True}),
])
def test_the_config_maps_as_transformers_maps_it(fields: dict[str, Any], tensors: set[str],
                                                 expected: dict[str, Any]) -> None:
    assert gguf_config(fields, tensors) == expected


def test_a_file_missing_a_weight_is_one_clear_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    whole = gguf.GGUFReader(str(write_llama_gguf(tiny_models["target"], tmp_path / "whole.gguf")))
    cut = tmp_path / "cut.gguf"
    writer = gguf.GGUFWriter(str(cut), "llama")
    for field in whole.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            sub = gguf.GGUFValueType(field.types[-1]) if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), gguf.GGUFValueType(field.types[0]), sub_type=sub)
    for tensor in whole.tensors:
        if tensor.name != "blk.0.ffn_up.weight":
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ImportModelError, match=r"model\.layers\.0\.mlp\.up_proj\.weight .* is missing"):
        gguf_float_model(cut)
