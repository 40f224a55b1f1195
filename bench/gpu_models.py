"""Real-shaped targets with random weights, made on the device from a config, for the GPU check.

A Llama-3-8B-shaped model (bfloat16, 16 GB) cannot travel with the checkout, and its speed does
not depend on what its weights are. So the check makes one: random weights from the architecture's
config, created directly on the device, saved as safetensors where the verifier loads them. Its
tokenizer is a word-level vocabulary of the same size (``t0 t1 ...``), so every id the random model
emits decodes. The prompts are token ids.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: name -> LlamaConfig fields. "small" stands in for the real shape on a CPU dry run.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "small": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 1024},
}
SPECIALS = ["<pad>", "<unk>", "<eos>"]


def word_tokenizer(vocab_size: int, out_dir: Path) -> Any:
    """A word-level tokenizer of exactly ``vocab_size`` ids (3 specials, then ``t3`` ...), saved to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    tok.save_pretrained(out_dir)
    return tok


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def make_target(shape: str, out_dir: Path, device: str, dtype: torch.dtype = torch.bfloat16,
                seed: int = 0) -> dict[str, Any]:
    """Make (or reuse) a random model of ``shape`` in ``out_dir``; what was made and how long it took."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = SHAPES[shape]
    if (out_dir / "config.json").exists() and (out_dir / "specfleet-random.json").exists():
        return dict(json.loads((out_dir / "specfleet-random.json").read_text()))
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = word_tokenizer(fields["vocab_size"], out_dir)
    config = LlamaConfig(**fields, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(config)
    made_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    info = {"shape": shape, "parameters": params, "dtype": str(dtype).removeprefix("torch."), "device": device,
            "made_s": round(made_s, 2), "saved_s": round(time.perf_counter() - started - made_s, 2)}
    (out_dir / "specfleet-random.json").write_text(json.dumps(info))
    return info
