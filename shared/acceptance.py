"""The lossless accept/reject math of speculative decoding: small pure functions, no I/O.

Notation (Leviathan et al. 2023, Chen et al. 2023): the drafter proposed tokens x_0..x_{k-1}.
The target, run once over [last committed token, x_0, ..., x_{k-1}], gives distributions
p_0..p_k, where p_j is the target's distribution for the position of x_j and p_k is the
"bonus" position after all drafts. q_j is the distribution x_j was drawn from.

* Greedy target: accept x_j while x_j == argmax p_j. The extra token is argmax p at the first
  mismatch, or argmax p_k when all drafts were accepted.
* Sampling target: accept x_j with probability min(1, p_j(x_j) / q_j(x_j)). On the first
  rejection, sample the extra token from norm(max(0, p_j - q_j)). When all are accepted, sample
  it from p_k. The output then has exactly the target's distribution, whatever q was.
* Ids-only drafts: q_j is taken as one-hot on x_j. Then accept with probability p_j(x_j), and on
  rejection sample from p_j with x_j removed and renormalised. Lossless however x_j was chosen.

Every p and q here is the distribution *after* temperature/top-k/top-p, exactly as sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.sampling import sample


def verify_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Greedy verification. ``target_argmax[j] = argmax p_j`` for j = 0..k.

    Returns (number of drafts accepted, the verifier's extra token).
    """
    assert len(target_argmax) == len(draft) + 1, "need one target row per draft plus the bonus row"
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, int(target_argmax[n])


def matched(draft: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens of ``draft`` equal ``tokens`` (a continuous verifier's committed
    tokens, or the tokens a verifier decoded while the draft was on its way)."""
    n = 0
    for d, t in zip(draft, tokens, strict=False):
        if d != t:
            break
        n += 1
    return n


def accept_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(x)/q(x)) for the drafted token x (q(x) > 0 by construction)."""
    qx = float(q[token])
    return 1.0 if qx <= 0.0 else min(1.0, float(p[token]) / qx)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to sample from after a rejection.

    If p <= q everywhere (then p == q and a rejection had probability 0) fall back to p.
    """
    r = torch.clamp(p - q, min=0.0)
    total = float(r.sum())
    return p if total <= 0.0 else r / total


def one_hot(token: int, vocab: int) -> torch.Tensor:
    q = torch.zeros(vocab, dtype=torch.float32)
    q[token] = 1.0
    return q


def accepted_prefix(p_x: Sequence[float], q_x: Sequence[float], u: Sequence[float]) -> int:
    """How many leading drafts are accepted: x_j is kept while u_j < min(1, p_j(x_j) / q_j(x_j)).

    ``u`` are independent uniforms on [0, 1); ``q_x`` is 1 for ids-only drafts (one-hot q).
    """
    n = 0
    while n < len(p_x) and u[n] * q_x[n] < p_x[n]:  # u < p/q without dividing (q(x) > 0)
        n += 1
    return n


def verify_sampled(
    draft: Sequence[int],
    p: torch.Tensor,
    q: Sequence[torch.Tensor] | None,
    gen: torch.Generator,
) -> tuple[int, int]:
    """Speculative sampling. ``p`` is ``[k+1, V]``; ``q`` is k dense rows, or None for ids-only.

    Returns (number of drafts accepted, the verifier's extra token).
    """
    assert p.shape[0] == len(draft) + 1, "need one target row per draft plus the bonus row"
    k, vocab = len(draft), p.shape[-1]
    p_x = [float(p[j, t]) for j, t in enumerate(draft)]
    q_x = [float(q[j][t]) for j, t in enumerate(draft)] if q is not None else [1.0] * k
    n = accepted_prefix(p_x, q_x, torch.rand(k, generator=gen).tolist() if k else [])
    if n == k:
        return k, sample(p[k], gen)
    q_n = q[n] if q is not None else one_hot(draft[n], vocab)
    return n, sample(residual(p[n], q_n), gen)
