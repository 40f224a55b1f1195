"""The numbers a draft/target pair is judged by, measured on held-out text.

- held-out loss: next-token cross-entropy (nats/token);
- greedy agreement: how often draft argmax == target argmax, teacher-forced on held-out text;
- acceptance at temperature 1: sum_x min(p(x), q(x)) = 1 - TV(p, q), averaged over positions —
  the probability that lossless speculative sampling accepts one drafted token;
- accepted length per round at k: an exact replay of greedy speculative decoding (see
  ``greedy_round_lengths``) on the target's own greedy continuations of held-out prompts;
- decode cost: ms per token at batch 1 with a KV cache, median of several runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

EVAL_BATCH = 8


@dataclass(frozen=True)
class PairStats:
    greedy_agreement: float
    acceptance_t1: float
    positions: int


@torch.no_grad()
def heldout_loss(model: Any, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy over [N, T+1] windows."""
    total, count = 0.0, 0
    for chunk in windows.split(EVAL_BATCH):
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += chunk[:, 1:].numel()
    return total / count


@torch.no_grad()
def pair_stats(target: Any, draft: Any, windows: torch.Tensor) -> PairStats:
    """Greedy agreement and temperature-1 acceptance of draft vs target, teacher-forced on windows."""
    agree, accept, count = 0.0, 0.0, 0
    for chunk in windows.split(EVAL_BATCH):
        inputs = chunk[:, :-1]
        p = F.softmax(target(input_ids=inputs, use_cache=False).logits.float(), dim=-1)
        q = F.softmax(draft(input_ids=inputs, use_cache=False).logits.float(), dim=-1)
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        accept += float(torch.minimum(p, q).sum(-1).sum())
        count += inputs.numel()
    return PairStats(agree / count, accept / count, count)


def greedy_round_lengths(matches: list[bool], k: int) -> list[int]:
    """Accepted drafted tokens in each round of greedy speculative decoding with k drafts.

    matches[i] says whether the draft's argmax equals the target's token i, with both fed the
    target's greedy sequence before i. While the draft agrees its own proposals *are* that
    sequence, so a round starting at s accepts the run of matches from s (capped at k), the
    target then emits one token (its correction or the bonus), and the next round starts after
    it. This is exactly what real greedy speculative rounds produce, with two forward passes.
    """
    lengths, s = [], 0
    while s < len(matches):
        accepted = 0
        while accepted < k and s + accepted < len(matches) and matches[s + accepted]:
            accepted += 1
        lengths.append(accepted)
        s += accepted + 1
    return lengths


@torch.no_grad()
def greedy_decode(model: Any, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of a [1, P] prompt with a KV cache; returns the new token ids [new_tokens]."""
    out = model(input_ids=prompt, use_cache=True)
    past, produced = out.past_key_values, []
    for _ in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        produced.append(nxt)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
    return torch.cat(produced, dim=1)[0]


@torch.no_grad()
def spec_round_stats(target: Any, draft: Any, prompts: torch.Tensor, new_tokens: int, k: int) -> dict[str, float]:
    """Mean accepted drafted tokens per round (and tokens emitted per target pass) over prompts [N, P]."""
    lengths: list[int] = []
    for prompt in prompts:
        cont = greedy_decode(target, prompt[None], new_tokens)
        seq = torch.cat([prompt, cont])[None]
        draft_next = draft(input_ids=seq[:, :-1], use_cache=False).logits[0].argmax(-1)
        start = prompt.numel() - 1  # logits at prompt's last position predict the first new token
        matches = (draft_next[start:] == cont).tolist()
        lengths.extend(greedy_round_lengths(matches, k))
    mean = sum(lengths) / len(lengths)
    return {"k": k, "rounds": len(lengths), "mean_accepted": mean, "tokens_per_round": mean + 1}


@torch.no_grad()
def decode_costs(models: dict[str, Any], prompt: torch.Tensor, tokens: int = 128, runs: int = 7, threads: int = 1
                 ) -> dict[str, float]:
    """Median wall ms per decoded token of each model (batch 1, KV cache) at the given torch threads.

    Runs are interleaved across models (run 1 of each, then run 2 of each, ...) so a burst of
    load from other processes on a shared CPU hits every model alike and the ratio c stays fair.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    samples: dict[str, list[float]] = {name: [] for name in models}
    try:
        for model in models.values():
            greedy_decode(model, prompt, 8)  # warm-up
        for _ in range(runs):
            for name, model in models.items():
                t0 = time.perf_counter()
                greedy_decode(model, prompt, tokens)
                samples[name].append((time.perf_counter() - t0) * 1000 / tokens)
        return {name: statistics.median(values) for name, values in samples.items()}
    finally:
        torch.set_num_threads(before)
