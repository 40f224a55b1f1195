"""Exact target distributions of the first two output tokens, and binned chi-square tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from scipy.stats import chisquare

from shared.protocol import SamplingParams
from shared.sampling import probs_from_logits

MIN_EXPECTED = 5.0  # categories expected to hold fewer samples are pooled into one bin


@torch.inference_mode()
def first_two_distribution(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P[x1, x2] under the target alone: p(x1 | prompt) * p(x2 | prompt, x1), exactly."""
    p1 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], params)
    vocab = p1.shape[0]
    batch = torch.tensor([[*prompt, x] for x in range(vocab)])
    p2 = probs_from_logits(model(batch).logits[:, -1], params)  # row x1: p(x2 | prompt, x1)
    return p1[:, None] * p2


def chi_square_p(observed: Counter[int], expected_probs: Sequence[float], n: int) -> float:
    """Goodness of fit with rare categories pooled so every bin expects >= MIN_EXPECTED samples."""
    obs, exp = [], []
    pooled_obs, pooled_exp = 0.0, 0.0
    for cat, prob in enumerate(expected_probs):
        if prob * n >= MIN_EXPECTED:
            obs.append(float(observed.get(cat, 0)))
            exp.append(prob * n)
        else:
            pooled_obs += observed.get(cat, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    scale = sum(obs) / sum(exp)  # guards float drift; sums match up to rounding
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def lossless_p_values(samples: list[tuple[int, int]], joint: torch.Tensor) -> dict[str, float]:
    """p-values for the first token, the second token, and the (pooled) pair."""
    n = len(samples)
    vocab = joint.shape[0]
    first = Counter(a for a, _ in samples)
    second = Counter(b for _, b in samples)
    pairs = Counter(a * vocab + b for a, b in samples)
    return {
        "first": chi_square_p(first, joint.sum(1).tolist(), n),
        "second": chi_square_p(second, joint.sum(0).tolist(), n),
        "pair": chi_square_p(pairs, joint.flatten().tolist(), n),
    }
