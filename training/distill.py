"""Distilling a factorised draft from the teacher's top-k distributions over its own answers.

The loss at every position that predicts an answer token is the cross-entropy of the draft's
distribution against the teacher's top-k distribution (renormalised over those k): KL(p || q)
up to the teacher's constant entropy. Matching the whole distribution, not just the argmax,
is what raises acceptance at temperature 1 (Σ min(p, q) = 1 - TV) as well as greedy agreement.

The draft starts from the target's own token geometry: its embedding table (shared with its
head) is the rank-r SVD of the target's embedding, so tokens the target treats alike start
alike. Batches are drawn by (seed, step) alone, so a resumed run sees the batches an
uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shared.factorised import FactorisedLlamaConfig, FactorisedLlamaForCausalLM
from training.config import Settings, Shape
from training.loop import StageResult, run_stage
from training.teacher_logits import Sequence, TopK


def build_draft(shape: Shape, tokenizer: Any, target: Any, seed: int) -> FactorisedLlamaForCausalLM:
    """A fresh draft whose shared table is the target embedding's rank-r SVD (float32)."""
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"{shape}: hidden must divide by heads and heads by kv_heads")
    cfg = FactorisedLlamaConfig(
        embed_rank=shape.embed_rank, vocab_size=target.config.vocab_size, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=shape.max_positions,
        rope_theta=target.config.rope_parameters.get("rope_theta", 10000.0) if getattr(
            target.config, "rope_parameters", None) else 10000.0,
        rms_norm_eps=target.config.rms_norm_eps, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    draft = FactorisedLlamaForCausalLM(cfg)
    with torch.no_grad():
        table = svd_table(target.get_input_embeddings().weight.float(), shape.embed_rank)
        draft.model.embed_tokens.weight.copy_(table)
    return draft


def svd_table(embedding: torch.Tensor, rank: int) -> torch.Tensor:
    """``U_r · S_r``, scaled to unit RMS: the best rank-r map of ``embedding`` (vocab × hidden) that
    keeps its tokens' inner products (``E ≈ U_r S_r V_rᵀ``)."""
    u, s, _ = torch.linalg.svd(embedding, full_matrices=False)
    table = u[:, :rank] * s[:rank]
    return table / table.pow(2).mean().sqrt()


class AnswerBatches:
    """Batches of whole sequences of similar length, about ``batch_tokens`` tokens each."""

    def __init__(self, sequences: list[Sequence], topk: dict[str, TopK], seed: int, pad_id: int) -> None:
        if not sequences:
            raise ValueError("no teacher answers to distil from")
        self.sequences = sorted(sequences, key=lambda s: len(s.ids))
        self.topk = topk
        self.seed = seed
        self.pad_id = pad_id
        self.tokens = sum(len(s.answer) for s in sequences)

    def batch(self, step: int, batch_tokens: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step])
        start = int(rng.integers(0, len(self.sequences)))
        picked = [self.sequences[start]]
        width = len(picked[0].ids)
        i = start
        while True:  # neighbours in length order, alternating sides, until the batch is full
            i = (i + 1) % len(self.sequences)
            nxt = self.sequences[i]
            if (len(picked) + 1) * max(width, len(nxt.ids)) > batch_tokens or i == start:
                break
            picked.append(nxt)
            width = max(width, len(nxt.ids))
        return self._collate(picked, width)

    def _collate(self, picked: list[Sequence], width: int) -> dict[str, torch.Tensor]:
        ids = torch.full((len(picked), width - 1), self.pad_id, dtype=torch.long)
        rows, targets, weights = [], [], []
        for b, seq in enumerate(picked):
            full = torch.tensor(seq.ids, dtype=torch.long)
            ids[b, : len(full) - 1] = full[:-1]
            first = len(seq.prompt) - 1  # this position predicts the first answer token
            rows.append(b * (width - 1) + torch.arange(first, first + len(seq.answer)))
            top = self.topk[seq.id]
            targets.append(top.ids.long())
            weights.append(torch.softmax(top.logprobs.float(), -1))  # the top-k renormalised
        return {"input_ids": ids, "rows": torch.cat(rows), "target_ids": torch.cat(targets),
                "target_probs": torch.cat(weights)}


def soft_ce(draft: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over answer positions of -Σ_k p_k log q(id_k): KL to the top-k teacher plus its entropy."""
    hidden = draft.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["rows"])
    logq = F.log_softmax(draft.lm_head(rows).float(), -1)
    return -(batch["target_probs"] * logq.gather(1, batch["target_ids"])).sum(-1).mean()


def distill_draft(name: str, settings: Settings, tokenizer: Any, target: Any, batches: AnswerBatches,
                  ckpt_dir: Path) -> tuple[Any, StageResult]:
    draft = build_draft(settings.drafts[name], tokenizer, target, settings.seed + 1)
    result = run_stage(name, draft, soft_ce, batches, settings.distill[name], ckpt_dir, settings.checkpoint_every)
    return draft, result
