"""The target with penalties, the transformers way: ``LogitsProcessor``s over the full sequence.

An independent reference for specfleet's speculative penalties: each step runs the model over
the whole sequence and applies, in vLLM's order, the logit bias, transformers' own
``RepetitionPenaltyLogitsProcessor`` (prompt and output tokens, as vLLM), then OpenAI's
frequency and presence penalties over the generated tokens only.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from shared.protocol import SamplingParams
from shared.sampling import probs_from_logits


class LogitBias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


class OutputPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties, counting tokens after the prompt only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            for token in set(ids[self.prompt_len :].tolist()):
                count = int((ids[self.prompt_len :] == token).sum())
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    out = LogitsProcessorList()
    if params.logit_bias:
        out.append(LogitBias(dict(params.logit_bias)))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    out.append(OutputPenalties(prompt_len, params.frequency_penalty, params.presence_penalty))
    return out


@torch.inference_mode()
def next_logits(model: torch.nn.Module, prompt: list[int], generated: list[int],
                params: SamplingParams) -> torch.Tensor:
    """The penalised logits of the next token after prompt + generated."""
    ids = torch.tensor([prompt + generated])
    scores = model(ids).logits[:, -1].float()
    return processors(params, len(prompt))(ids, scores)[0]


def greedy_with_penalties(model: torch.nn.Module, prompt: list[int], max_new: int, params: SamplingParams,
                          eos_ids: set[int]) -> list[int]:
    out: list[int] = []
    for _ in range(max_new):
        token = int(next_logits(model, prompt, out, params).argmax())
        out.append(token)
        if token in eos_ids:
            break
    return out


def first_two_with_penalties(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P[x1, x2] of the target with penalties, exactly (x2's penalties count x1 as generated)."""
    p1 = probs_from_logits(next_logits(model, prompt, [], params), params)
    p2 = torch.stack([probs_from_logits(next_logits(model, prompt, [x], params), params) for x in range(len(p1))])
    return p1[:, None] * p2
