"""A Llama-family GGUF file's weights as a plain transformers model in float32, read directly.

transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``) gives the same model, but
slowly: its reader builds a numpy view per metadata entry (seconds for SmolLM2's 49,152-token
vocabulary), it builds gguf's tensor-name table once per module (397 times), and it initializes
two models at random. A drafter on the Q4_1 copy of SmolLM2-135M spent 12.7 s of one core there
before it could draft (and 57 s at ``specfleet up``, two drafters and the verifier starting on 2
cores). Here the same steps take about 1 s:

* the metadata and tensor table come from ``shared.gguf_files`` (``struct``, one pass);
* the config is transformers' own mapping of the metadata (``GGUF_TO_TRANSFORMERS_MAPPING``),
  applied as its loader applies it: the same keys, the same defaults, the same special cases for
  these architectures;
* each tensor is dequantized from a memory map of the file by the ``gguf`` package's
  ``dequantize`` (what transformers calls), and a ``llama`` file's query and key rows go back from
  llama.cpp's interleaved rotary pairs to the halves transformers' rotary embedding uses;
* the names are gguf's own table (``get_tensor_name_map``), built once.

``tests/unit/test_gguf_weights.py`` checks that the config, the generation config, every weight and
buffer and the logits are bitwise what transformers' loader gives (its model copied into a plain one, as
specfleet imported GGUF files before), on llama files in float32, float16 and Q4_1, with and without a
head of their own, and on a qwen2 file. One deliberate difference: a ``llama`` file that does not say
its KV head count gets its key rows put back with the attention head count, as llama.cpp and the
config both assume (transformers' loader leaves them interleaved, and its model attends wrongly).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import numpy as np

from shared.errors import ModelLoadError
from shared.gguf_files import GgufHeader, gguf_header

#: the GGUF architectures whose query and key rows llama.cpp's converter interleaved (transformers'
#: loader undoes it for these alone)
PERMUTED = frozenset({"llama"})
#: transformers' ``no_init_weights`` swaps torch's initializers for the whole process: one model at a time
_NO_INIT = threading.Lock()


def gguf_config(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The transformers config dict of a GGUF file's metadata, as transformers' GGUF loader makes it."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch = str(fields["general.architecture"])
    # transformers' loader: a "llama" file named exactly "mistral" is a Mistral model
    updated = "mistral" if "llama" in arch and fields.get("general.name") == "mistral" else arch
    mapping = cast(dict[str, dict[str, Any]], GGUF_TO_TRANSFORMERS_MAPPING["config"])
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults: dict[str, Any] = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for key, default in defaults.items():
        config.setdefault(key, default)
    for key, value in fields.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        renamed = mapping.get(prefix, {}).get(rest, -1)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if "vocab_size" not in config and isinstance(tokens := fields.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(tokens)
    return config


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows per head from llama.cpp's interleaved pairs ``[x0, y0, x1, y1, ...]`` back to halves
    ``[x0, x1, ..., y0, y1, ...]`` (the inverse of ``shared.gguf_write.permute_rotary``)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor(data: np.ndarray, start: int, shape: list[int], kind: int) -> np.ndarray:
    """One tensor of the file as float32, rows first (GGUF lists a tensor's dimensions innermost first)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType(kind)
    block, size = GGML_QUANT_SIZES[qtype]
    row_bytes = shape[0] // block * size
    rows = int(np.prod(shape[1:], dtype=np.int64))
    raw = data[start : start + rows * row_bytes].reshape(*reversed(shape[1:]), row_bytes)
    return np.asarray(dequantize(raw, qtype), dtype=np.float32)


def gguf_float_weights(path: Path, header: GgufHeader | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A GGUF file's config dict and its tensors by gguf name, each float32 and owned (not the map);
    ``header``: the file's, when the caller has parsed it already."""
    header = header or gguf_header(path)
    fields = header.fields
    config = gguf_config(fields, {name for name, *_ in header.tensors})
    data = np.memmap(path, dtype=np.uint8, mode="r")
    permuted = str(fields["general.architecture"]) in PERMUTED
    heads = _head_counts(config, path) if permuted else {}
    tensors: dict[str, np.ndarray] = {}
    for name, shape, kind, offset in header.tensors:
        weight = _tensor(data, header.data_start + offset, shape, kind)
        part = name.split(".")[-2] if name.count(".") >= 2 else ""
        if permuted and part in heads:  # a bias too, as transformers' loader does
            weight = _unpermute(weight, heads[part])
        tensors[name] = np.array(weight, copy=True) if np.may_share_memory(weight, data) else weight
    del data
    return config, tensors


def _head_counts(config: dict[str, Any], path: Path) -> dict[str, int]:
    """The heads a ``llama`` file's query and key rows are interleaved by: its attention heads, and its KV
    heads (the attention heads where it does not say, as llama.cpp and the config assume)."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads < 1 or kv_heads < 1:
        raise ModelLoadError(f"{path.name}: its head counts ({heads!r}, KV {kv_heads!r}) are not positive integers; "
                             "the file's metadata is corrupt")
    return {"attn_q": heads, "attn_k": kv_heads}


def gguf_float_model(path: Path, header: GgufHeader | None = None) -> Any:
    """``path``'s model as a plain transformers model in float32, in eval mode, its weights the file's
    dequantized exactly (a Q4_1 block's d * q + m). ModelLoadError if a weight is missing or misshapen."""
    import torch
    from gguf import get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config, tensors = gguf_float_weights(path, header)
    with _NO_INIT, no_init_weights():  # every weight is loaded below: no random draws first (1.3 s for SmolLM2)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.tie_weights()  # what the skipped init_weights does after it draws
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == model.config.model_type), None)
    if arch is None:
        raise ModelLoadError(f"{path.name}: the gguf package names no tensors for a {model.config.model_type!r} model")
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    state: dict[str, torch.Tensor] = {}
    for hf_name, param in model.state_dict().items():
        stem, dot, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(stem)
        weight = tensors.get(f"{gguf_name}.{suffix}") if gguf_name and dot else None
        if weight is None and model.config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue  # tied to the embedding, which is loaded
        if weight is None or tuple(weight.shape) != tuple(param.shape):
            found = "missing" if weight is None else f"shaped {tuple(weight.shape)}"
            raise ModelLoadError(f"{path.name}: the weight for {hf_name} {tuple(param.shape)} is {found}; the file "
                                 "does not match its own metadata")
        state[hf_name] = torch.from_numpy(weight)
    model.load_state_dict(state, strict=False)
    return model.eval()
