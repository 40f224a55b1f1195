"""Race sampling: each token of a sampled request is the winner of a keyed exponential race, so a
drafter can draft the very tokens the verifier will choose (coupled speculative sampling).

The verifier draws token ``n`` of a request (``n`` counts the prompt) as

    x_n = argmax_x  p_n(x) / E_n(x),    E_n(x) independent Exp(1) variates,

which is the Gumbel-max trick (``-log E`` are Gumbel variates): an exact sample of ``p_n``, the
distribution after penalties, temperature, top-k and top-p. The variates come from a generator
keyed by (the request's race key, ``n``): the same key and position give the same variates,
anywhere. The verifier tells the session's drafter the key, and the drafter drafts
``argmax_x q_n(x) / E_n(x)`` from its own distribution with the same variates. The two winners
agree whenever p and q put their mass alike: with ``s = Σ min(p, q)`` they agree with probability
at least ``s / (2 - s)``, and in practice close to ``s`` (on the demo pair at T = 1, 0.750 against
s = 0.801 over 1000 positions of the target's own samples, 64 races each).

Verification is then greedy verification against the winners: a draft is accepted while it equals
the verifier's winner at its position, and the verifier's own token is the winner where they
differ (or after the last draft). So the output does not depend on the drafts at all: token ``n``
is ``race(p_n, E_n)`` whoever drafted what, which makes it an exact sample of the target,

* for any drafts, even a lying drafter's (it cannot steer a race whose outcome it only predicts);
* whenever it is decoded: a session may be decoded target-only while its draft travels
  (``services.verifier.fill``), and a seeded request gives the same text with or without
  speculation, on any drafter, at any timing;
* as the stream sampler is, position by position: the variates of different positions are
  independent, and independent of the model (they are drawn from the key alone).

A seeded request's key is a hash of its seed, so it is reproducible; an unseeded request's is
fresh entropy. The drafter needs no q on the wire (ids only) and no nucleus: one argmax per token.
The price: V variates per position on each side (float64 uniforms from a keyed generator and one
log each: about 30 µs a row for V = 4096 on this CPU; a GPU generates them in the kernel that
takes the argmax).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from shared.sampling import hashed_generator

#: the smallest exponential variate used
_TINY = 1e-300


def race_key(seed: int | None) -> int:
    """A request's race key: a hash of its seed (reproducible), or fresh entropy."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.blake2b(f"race:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def noise(key: int, position: int, vocab: int) -> torch.Tensor:
    """``E_n`` for position ``n`` of the request keyed ``key``: Exp(1) variates, float64, one per
    vocabulary entry (a smaller vocabulary gets a prefix of the same variates)."""
    return keyed_exponentials(f"race:{key}:{position}", vocab)


def keyed_exponentials(label: str, vocab: int) -> torch.Tensor:
    """``vocab`` Exp(1) variates, float64, from the generator keyed by ``label``: -log(1 - u) of
    its uniforms, never exactly 0 (a draw of exactly 0 would make 0 / 0 for a token p excludes)."""
    uniform = torch.rand(vocab, generator=hashed_generator(label), dtype=torch.float64)
    return uniform.neg_().log1p_().neg_().clamp_(min=_TINY)


def ratios(probs: torch.Tensor, key: int, positions: Sequence[int]) -> torch.Tensor:
    """``p / E`` for each row of ``probs [R, V]`` (row i at ``positions[i]``), float64 on the CPU;
    tokens that p excludes score 0. The winner of row i is its argmax."""
    variates = torch.stack([noise(key, n, probs.shape[-1]) for n in positions])
    return probs.detach().to("cpu", torch.float64) / variates


def winners(probs: torch.Tensor, key: int, positions: Sequence[int]) -> list[int]:
    """The race winner of each row of ``probs [R, V]``: an exact sample of that row."""
    if probs.shape[0] == 0:
        return []
    return [int(x) for x in ratios(probs, key, positions).argmax(-1).tolist()]


def top_two(probs: torch.Tensor, key: int, position: int) -> tuple[int, int]:
    """The winner of one row and its runner-up (the token that wins if the winner is not the
    verifier's: a drafter's best guess at the verifier's token after a rejection)."""
    best = ratios(probs.unsqueeze(0), key, [position])[0].topk(2).indices.tolist()
    return int(best[0]), int(best[-1])
