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

from shared.errors import ModelLoadError
from shared.gguf_weights import _head_counts, _unpermute, gguf_config
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


def rewritten(source: Path, out: Path, arch: str = "llama", drop: tuple[str, ...] = (),
              extra: dict[str, np.ndarray] | None = None, keys_dropped: tuple[str, ...] = ()) -> Path:
    """``source`` (a llama GGUF file) written again as an ``arch`` file (its metadata keys renamed),
    without the tensors ``drop`` names and the metadata keys ``keys_dropped`` names, with ``extra`` tensors."""
    whole = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), arch)
    for field in whole.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture", *keys_dropped)):
            sub = gguf.GGUFValueType(field.types[-1]) if len(field.types) > 1 else None
            name = f"{arch}.{field.name.removeprefix('llama.')}" if field.name.startswith("llama.") else field.name
            writer.add_key_value(name, field.contents(), gguf.GGUFValueType(field.types[0]), sub_type=sub)
    for tensor in whole.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_file_without_a_head_of_its_own_is_tied_as_transformers_ties_it(tiny_models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    whole = write_llama_gguf(tiny_models["target"], tmp_path / "whole.gguf")
    tied = rewritten(whole, tmp_path / "tied.gguf", drop=("output.weight",))
    ours = gguf_float_model(tied)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_same_model(ours, transformers_model(tied))


def test_a_qwen2_file_keeps_its_rows_and_biases_as_transformers_does(tiny_models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """A qwen2 file's query and key rows are not interleaved (llama.cpp's converter leaves them), and
    its query, key and value projections have biases."""
    whole = write_llama_gguf(tiny_models["target"], tmp_path / "whole.gguf")
    shapes = {t.name: t.data.shape for t in gguf.GGUFReader(str(whole)).tensors}
    rng = np.random.default_rng(0)
    biases = {f"blk.{i}.attn_{p}.bias": rng.standard_normal((shapes[f"blk.{i}.attn_{p}.weight"][0],), np.float32)
              for i in range(sum(n.endswith("attn_norm.weight") for n in shapes)) for p in "qkv"}
    qwen = rewritten(whole, tmp_path / "qwen2.gguf", arch="qwen2", extra=biases)
    ours = gguf_float_model(qwen)
    assert ours.config.model_type == "qwen2"
    assert torch.equal(ours.model.layers[0].self_attn.q_proj.bias, torch.from_numpy(biases["blk.0.attn_q.bias"]))
    assert_same_model(ours, transformers_model(qwen))


def test_a_file_missing_a_weight_is_one_clear_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    whole = write_llama_gguf(tiny_models["target"], tmp_path / "whole.gguf")
    cut = rewritten(whole, tmp_path / "cut.gguf", drop=("blk.0.ffn_up.weight",))
    with pytest.raises(ImportModelError, match=r"model\.layers\.0\.mlp\.up_proj\.weight .* is missing"):
        gguf_float_model(cut)


@pytest.mark.parametrize(("config", "want"), [
    ({"num_attention_heads": 9, "num_key_value_heads": 3}, {"attn_q": 9, "attn_k": 3}),
    ({"num_attention_heads": 4}, {"attn_q": 4, "attn_k": 4}),  # no KV count: llama.cpp's and the config's default
    ({"num_attention_heads": 0}, None),
    ({"num_key_value_heads": 2}, None),
    ({"num_attention_heads": [4], "num_key_value_heads": 4}, None),
])
def test_a_llama_files_rows_are_put_back_by_its_head_counts(config: dict[str, Any],
                                                            want: dict[str, int] | None) -> None:
    """Transformers' loader leaves the rows interleaved where the file does not say its KV heads (its model
    then attends wrongly); here the attention heads stand in, as llama.cpp and the config assume."""
    if want is None:
        with pytest.raises(ModelLoadError, match=r"head counts .* corrupt"):
            _head_counts(config, Path("x.gguf"))
    else:
        assert _head_counts(config, Path("x.gguf")) == want


def test_a_file_that_contradicts_its_head_counts_is_one_clear_line(tiny_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """The tiny target has 2 heads and 1 KV head; without its KV count the key projections are half
    the width the config then expects."""
    whole = write_llama_gguf(tiny_models["target"], tmp_path / "whole.gguf")
    no_kv = rewritten(whole, tmp_path / "no-kv.gguf", keys_dropped=("llama.attention.head_count_kv",))
    with pytest.raises(ImportModelError, match=r"k_proj\.weight .* is shaped"):
        gguf_float_model(no_kv)
