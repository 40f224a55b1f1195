"""Writing a trained model as a shippable Hugging Face directory: fp16 safetensors + tokenizer.

fp16 halves the bytes (the whole family must fit in 25 MB in git); ``shared.models.load_model``
upcasts to fp32 on CPU, so serving precision is unaffected.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def export_model(model: Any, tokenizer: Any, out_dir: Path) -> int:
    """Save model (as fp16) and tokenizer to out_dir; return the weight file's size in bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.float16).eval()
    half.generation_config.eos_token_id = tokenizer.eos_token_id
    half.generation_config.pad_token_id = tokenizer.pad_token_id
    half.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))


def parameter_count(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
