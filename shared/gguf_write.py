"""Write a Llama-architecture Hugging Face model as a GGUF file that llama.cpp runs.

    write_llama_gguf(Path("models/my-draft"), Path("my-draft.gguf"))   # float32 (or float16) tensors

What it does, in the GGUF conventions llama.cpp reads (its ``llama`` architecture):

* metadata: the shape (layers, width, heads, KV heads, MLP width, context), RMSNorm's epsilon,
  RoPE's base, and the tokenizer: a byte-level BPE as ``tokenizer.ggml.model = gpt2`` with its
  token table in id order, its merges, the special tokens as control tokens, and eos/bos ids;
* tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ..., ``output``). Query and key
  projections are reordered per head from the rotate-half layout Hugging Face's rotary embedding
  uses to the interleaved pairs llama.cpp's ``llama`` rotary embedding uses, so both compute the
  same attention.

The tests make their tiny GGUF drafts with it (from the tiny models ``shared.models`` makes), and
llama.cpp's quantizer (``shared.gguf_copies.quantize``) turns its output into 4- and 8-bit copies.
It handles Llama decoders with byte-level BPE tokenizers; anything else is refused with a
ModelLoadError that says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.models import ModelLoadError, load_model

CONTROL, NORMAL = 3, 1  # gguf token types


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query or key projection's rows, per head, from halves ``[x0..x_{d/2-1}, y0..]`` (rotate-half)
    to pairs ``[x0, y0, x1, y1, ...]`` (interleaved): row ``i`` of a head's first half goes to ``2i``,
    row ``i`` of its second half to ``2i + 1``."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_parts(model_dir: Path) -> tuple[list[str], list[int], list[str]]:
    """Token table (id order), token types and merges of a byte-level BPE ``tokenizer.json``."""
    try:
        data = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir} has no readable tokenizer.json ({exc}); the GGUF writer needs a fast "
                             "tokenizer") from None
    model = data.get("model", {})
    if model.get("type") != "BPE" or (data.get("pre_tokenizer") or {}).get("type") not in ("ByteLevel", "Sequence"):
        raise ModelLoadError(f"{model_dir}'s tokenizer is not a byte-level BPE; the GGUF writer handles only those")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    vocab.update(special)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, index in vocab.items():
        tokens[index] = text
    types = [CONTROL if t in special else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def write_llama_gguf(model_dir: Path, out: Path, dtype: str = "f32") -> Path:
    """``out``: the model in ``model_dir`` as a GGUF file (tensors in float32, or float16 with
    ``dtype="f16"``, or with ``dtype="q4_1"`` the layers' matrices in Q4_1 blocks by gguf's own
    quantizer and the embedding and head in float32; norms stay float32). Written whole, then
    renamed into place."""
    import gguf

    loaded = load_model(model_dir, dtype="float32")
    cfg = loaded.model.config
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if cfg.model_type != "llama" or rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{model_dir} is a {cfg.model_type!r} model; the GGUF writer handles plain Llama ones")
    tokens, types, merges = _tokenizer_parts(model_dir)
    if len(tokens) != cfg.vocab_size:
        raise ModelLoadError(f"{model_dir}: the tokenizer has {len(tokens)} tokens, the model {cfg.vocab_size}")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // heads)
    theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[dtype])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if loaded.tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(int(loaded.tokenizer.eos_token_id))
    if loaded.tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(int(loaded.tokenizer.bos_token_id))
    writer.add_add_bos_token(False)
    for name, array in _tensors(loaded.model, heads, kv_heads, dtype):
        if dtype == "q4_1" and name.startswith("blk.") and array.ndim == 2:
            q4 = gguf.GGMLQuantizationType.Q4_1
            writer.add_tensor(name, gguf.quants.quantize(array, q4), raw_dtype=q4)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def _tensors(model: Any, heads: int, kv_heads: int, dtype: str) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, array) of every weight; matrices in ``dtype``, vectors in float32."""
    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    matrix = np.float16 if dtype == "f16" else np.float32
    out = [("token_embd.weight", state["model.embed_tokens.weight"].astype(matrix)),
           ("output_norm.weight", state["model.norm.weight"])]
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    out.append(("output.weight", head.astype(matrix)))
    names = {"self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}."
        out += [(f"blk.{i}.attn_norm.weight", state[pre + "input_layernorm.weight"]),
                (f"blk.{i}.ffn_norm.weight", state[pre + "post_attention_layernorm.weight"]),
                (f"blk.{i}.attn_q.weight",
                 permute_rotary(state[pre + "self_attn.q_proj.weight"], heads).astype(matrix)),
                (f"blk.{i}.attn_k.weight",
                 permute_rotary(state[pre + "self_attn.k_proj.weight"], kv_heads).astype(matrix))]
        out += [(f"blk.{i}.{gg}.weight", state[pre + hf + ".weight"].astype(matrix)) for hf, gg in names.items()]
    return out
