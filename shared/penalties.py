"""OpenAI's and vLLM's penalties on logits: logit_bias, repetition, frequency and presence.

They apply to the target's logits before temperature, top-k and top-p, in vLLM v1's order:

1. ``logit_bias``: add each listed token's bias;
2. ``repetition_penalty`` r (vLLM): every token seen in the prompt *or* the output so far has its
   logit divided by r when positive, multiplied by r otherwise;
3. ``frequency_penalty`` f: subtract f x (times the token occurred in the output so far);
4. ``presence_penalty`` s: subtract s once from every token that occurred in the output so far.

Frequency and presence count generated tokens only (OpenAI, vLLM), the prompt's never.

Speculatively, a round verifies k drafts at once: row j of the round predicts the token after
drafts 0..j-1, so row j counts those drafts as generated. Whatever of them is later rejected,
the row that predicted each *committed* token saw exactly that token's true prefix, so p stays
the target's penalised distribution and acceptance stays lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.protocol import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)


def output_counts(generated: Sequence[int], drafts: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """``[k + 1, V]`` occurrence counts of the output as row j sees it: generated + drafts[:j]."""
    base = torch.bincount(torch.tensor(list(generated), dtype=torch.long, device=device), minlength=vocab)
    counts = base.unsqueeze(0).repeat(len(drafts) + 1, 1).float()
    if drafts:
        seen = torch.nn.functional.one_hot(torch.tensor(list(drafts), device=device), vocab).float().cumsum(0)
        counts[1:] += seen
    return counts


def apply_penalties(rows: torch.Tensor, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int],
                    drafts: Sequence[int] = ()) -> torch.Tensor:
    """The penalised logits of a round's ``k + 1`` rows (a new tensor; ``rows`` is unchanged)."""
    vocab = rows.shape[-1]
    out = rows.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=out.device)
        out[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=out.device)
    counts = output_counts(generated, drafts, vocab, out.device)
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=out.device)
        in_prompt[torch.tensor(list(prompt), dtype=torch.long, device=out.device)] = True
        mask = seen | in_prompt
        r = params.repetition_penalty
        out = torch.where(mask, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * seen.float()
    return out
