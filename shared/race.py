"""Race sampling: each token of a sampled request is the winner of a keyed exponential race, so a
drafter can draft the very tokens the verifier will choose (coupled speculative sampling).

The verifier draws token ``n`` of a request (``n`` counts the prompt) as the winner of a race
over p_n, the distribution after penalties, temperature, top-k and top-p. A race over weights w
with E(x) independent Exp(1) variates is won by ``argmax_x w(x) / E(x)``: the Gumbel-max trick
(``-log E`` are Gumbel variates), an exact sample of w / sum(w). The race is run in two levels
(:func:`finishers`): the vocabulary is cut into blocks of BLOCK tokens, a race over the blocks'
masses picks a block, and a race within that block picks the token. The block wins with
probability m_b / sum(m), the token within it with p(x) / m_b, so the token with p(x): an exact
sample. The variates of each level come from generators keyed by (the request's race key, ``n``),
and the block's by its number as well: the same key and position give the same variates, anywhere,
and the inner race's variates are independent of which block won (their own stream).

The verifier tells the session's drafter the key, and the drafter drafts the same race over its
own distribution q_n with the same variates. The two winners agree whenever p and q put their
mass alike: with ``s = Σ min(p, q)`` a one-level race agrees with probability at least
``s / (2 - s)``, and in practice close to ``s``. Two levels cost little of that: over 283
positions of the target's own T = 1 chat answers, the Q4_1 copy's race agreed with the target's
0.954 of the time in two levels of 256, 0.957 in one (s = 0.966, 200 races each; 2026-12-07), and
they draw V / 256 + 256 variates a position instead of V: 448 instead of 49,152 for SmolLM2, whose
one-level race cost 0.52 ms a drafted token on the edge core and 2.6 ms a 5-row verification.

Verification is then greedy verification against the winners: a draft is accepted while it equals
the verifier's winner at its position, and the verifier's own token is the winner where they
differ (or after the last draft). So the output does not depend on the drafts at all: token ``n``
is the race's winner over p_n whoever drafted what, which makes it an exact sample of the target,

* for any drafts, even a lying drafter's (it cannot steer a race whose outcome it only predicts);
* whenever it is decoded: a session may be decoded target-only while its draft travels
  (``services.verifier.fill``), and a seeded request gives the same text with or without
  speculation, on any drafter, at any timing;
* as the stream sampler is, position by position: the variates of different positions are
  independent, and independent of the model (they are drawn from the key alone).

A seeded request's key is a hash of its seed, so it is reproducible; an unseeded request's is
fresh entropy. The drafter needs no q on the wire (ids only) and no nucleus: one race per token.
A smaller vocabulary (a draft model's, unpadded) is zero-padded to whole blocks, so it races over
the same blocks and variates as a padded one.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from shared.sampling import hashed_generator

#: the smallest exponential variate used
_TINY = 1e-300
#: tokens per block of the two-level race
BLOCK = 256


def race_key(seed: int | None) -> int:
    """A request's race key: a hash of its seed (reproducible), or fresh entropy."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.blake2b(f"race:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def label(key: int, position: int) -> str:
    """What keys the variates of position ``n`` of the request keyed ``key``."""
    return f"race:{key}:{position}"


def keyed_exponentials(label: str, count: int) -> torch.Tensor:
    """``count`` Exp(1) variates, float64, from the generator keyed by ``label``: -log(1 - u) of
    its uniforms, never exactly 0 (a draw of exactly 0 would make 0 / 0 for a weight of 0)."""
    uniform = torch.rand(count, generator=hashed_generator(label), dtype=torch.float64)
    return uniform.neg_().log1p_().neg_().clamp_(min=_TINY)


def blocks(probs: torch.Tensor) -> torch.Tensor:
    """``probs [..., V]`` as float64 on the CPU, zero-padded to ``[..., ceil(V / BLOCK), BLOCK]``."""
    p = probs.detach().to("cpu", torch.float64)
    pad = -p.shape[-1] % BLOCK
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    return p.unflatten(-1, (-1, BLOCK))


def finishers(probs: torch.Tensor, tag: str, places: int = 1) -> list[int]:
    """The winner of the race keyed ``tag`` over one distribution ``probs [V]``, and with ``places``
    = 2 the runner-up: the token that wins when the winner is left out (the same variates)."""
    rows = blocks(probs)
    return _finish(rows, rows.sum(-1), tag, places)


def _finish(rows: torch.Tensor, masses: torch.Tensor, tag: str, places: int) -> list[int]:
    """:func:`finishers` over ``rows [B, BLOCK]`` from :func:`blocks` and ``masses [B]``, their sums."""
    block_e = keyed_exponentials(tag, masses.shape[0])
    scores = masses / block_e
    first = int(scores.argmax())
    inner = rows[first] / keyed_exponentials(f"{tag}:{first}", BLOCK)
    best = inner.topk(2).indices.tolist()
    winner = first * BLOCK + best[0]
    if places == 1:
        return [winner]
    # without the winner its block's mass drops; it stays first, or the next block wins
    scores[first] = (masses[first] - rows[first, best[0]]).clamp(min=0.0) / block_e[first]
    second = int(scores.argmax())
    if second == first or float(scores[second]) == 0.0:
        return [winner, first * BLOCK + best[1]]
    return [winner, second * BLOCK + int((rows[second] / keyed_exponentials(f"{tag}:{second}", BLOCK)).argmax())]


def winners(probs: torch.Tensor, key: int, positions: Sequence[int]) -> list[int]:
    """The race winner of each row of ``probs [R, V]`` (row i at ``positions[i]``): an exact sample
    of that row."""
    if probs.shape[0] == 0:
        return []
    rows = blocks(probs)
    masses = rows.sum(-1)  # every row's blocks in one op
    return [_finish(rows[i], masses[i], label(key, n), 1)[0] for i, n in enumerate(positions)]


def top_two(probs: torch.Tensor, key: int, position: int) -> tuple[int, int]:
    """The winner of one row and its runner-up (the token that wins if the winner is not the
    verifier's: a drafter's best guess at the verifier's token after a rejection)."""
    first, second = finishers(probs, label(key, position), places=2)
    return first, second
