"""Writing a trained draft as a shippable Hugging Face directory: bfloat16 safetensors + tokenizer.

bfloat16 halves the bytes (both drafts must fit in 32 MB of git); ``shared.models.load_model``
casts to the serving dtype (float32 on CPUs without native bfloat16), so nothing else changes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def export_model(model: Any, tokenizer: Any, out_dir: Path) -> int:
    """Save model (as bfloat16) and tokenizer to out_dir; return the weight file's size in bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.bfloat16).eval()
    half.generation_config.eos_token_id = tokenizer.eos_token_id
    half.generation_config.pad_token_id = tokenizer.pad_token_id
    half.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))


def parameter_count(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
