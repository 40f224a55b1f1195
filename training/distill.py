"""Distilling drafts from the target: KL(target || draft) on the target's full next-token logits.

Matching the target's whole distribution (not just its argmax on the corpus) is what raises
speculative acceptance: acceptance at temperature 1 is 1 - TV(p, q), which the KL bounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from training.batches import WindowSampler
from training.config import Settings
from training.loop import LossFn, StageResult, run_stage
from training.train import build_model, logits_of


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax(teacher) || softmax(student)); 0 iff the distributions match."""
    vocab = teacher_logits.size(-1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab), dim=-1)
    s = F.log_softmax(student_logits.float().reshape(-1, vocab), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def distill_loss_fn(target: torch.nn.Module) -> LossFn:
    """A loss for ``run_stage``: the frozen target's logits teach the draft on the same inputs."""
    target.eval()

    def loss(draft: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher = logits_of(target, inputs)
        return kl_loss(teacher, logits_of(draft, inputs))

    return loss


def distill_draft(name: str, settings: Settings, tokenizer: Any, target: torch.nn.Module, sampler: WindowSampler,
                  ckpt_dir: Path) -> tuple[Any, StageResult]:
    for p in target.parameters():
        p.requires_grad_(False)
    draft = build_model(settings.drafts[name], tokenizer, settings.seed + 1)
    # offset the batch stream so drafts do not see exactly the target's first windows in order
    shifted = WindowSampler(*sampler.streams, sampler.seq_len, sampler.docs_weight, sampler.seed + 7919)
    result = run_stage(name, draft, distill_loss_fn(target), shifted, settings.distill[name], ckpt_dir,
                       settings.checkpoint_every)
    return draft, result
