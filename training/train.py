"""Pretraining the target: a Llama-style causal LM trained from scratch with cross-entropy.

Also where every model of the family is built (``build_model``), so target and drafts share
the vocabulary, special-token ids and position limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from training.batches import WindowSampler
from training.config import Settings, Shape
from training.loop import StageResult, run_stage


def build_model(shape: Shape, tokenizer: Any, seed: int) -> Any:
    """A freshly initialised LlamaForCausalLM (fp32, tied embeddings to save bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"{shape}: hidden must divide by heads and heads by kv_heads")
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def logits_of(model: Any, inputs: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inputs, use_cache=False).logits


def ce_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a [B, T+1] batch."""
    logits = logits_of(model, batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


def pretrain_target(settings: Settings, tokenizer: Any, sampler: WindowSampler, ckpt_dir: Path) -> tuple[Any,
                                                                                                          StageResult]:
    model = build_model(settings.target, tokenizer, settings.seed)
    result = run_stage("target", model, ce_loss, sampler, settings.pretrain, ckpt_dir, settings.checkpoint_every)
    return model, result
