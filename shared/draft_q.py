"""Sampling-aware drafting: the q a drafter samples from and sends, and how the verifier reads it.

A sampled request is drafted from the request's own distribution: temperature, top-k and top-p
applied exactly as the target applies them (``shared.sampling.probs_from_logits``). That
distribution is cut to a *nucleus* that suits an edge link and a large vocabulary: the most
likely tokens, in order, until their mass reaches ``mass`` or there are ``max_entries`` of them.
On the wire (``shared.protocol.SparseQ``) ids are uint32 and probabilities float16: 6 bytes per
entry, whatever the vocabulary. The defaults (mass 0.98, at most 4096 entries) come from
``python -m bench qwire`` (bench/results/qwire.md): on the demo pair at T = 1 they keep 99 % of
the full q's acceptance at ~11 KB per position; a slow link lowers the cap, at the price that
table shows.

Exactness: the drafter samples from exactly what it sends, q = w / sum(w), where w are the
float16 values and the sum is taken in float64; the verifier reads the same q back with
:func:`read`. Speculative sampling is lossless for any q, so the cut never changes the output;
it only costs acceptance: sum(min(p, q_cut)) >= sum(min(p, q)) - (the mass left out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shared.coupling import race_winner
from shared.protocol import MAX_Q_ENTRIES, SamplingParams, SparseQ
from shared.sampling import probs_from_logits, sample

#: Tolerance on a wire q's total mass above 1 (float16 rounding) before it is refused.
Q_MASS_TOLERANCE = 2e-3


class DraftError(ValueError):
    """A draft's q is inconsistent with its tokens (refused; the round is not verified)."""


@dataclass(frozen=True)
class Nucleus:
    """How much of the draft distribution goes on the wire."""

    mass: float = 0.98  # keep the most likely tokens until their probability reaches this
    max_entries: int = MAX_Q_ENTRIES  # but never more than this many (the bound on bytes per position)

    def __post_init__(self) -> None:
        if not 0.0 < self.mass <= 1.0:
            raise ValueError(f"the q nucleus mass must be in (0, 1], got {self.mass}")
        if not 1 <= self.max_entries <= MAX_Q_ENTRIES:
            raise ValueError(f"the q nucleus size must be in [1, {MAX_Q_ENTRIES}], got {self.max_entries}")


#: How :func:`cut` finds the most likely tokens, from measurements on this project's CPU (one core):
#:
#: * on a flat T = 1 row of the demo draft model (4,096 entries) the nucleus holds ~1,800 entries;
#:   torch's sort or ``topk(4096)`` took ~230 us there, an exact radix sort (:func:`descending`)
#:   ~45 us, about what ``topk(256)`` takes on such a row. So up to RADIX_FIRST entries the row is
#:   radix-sorted at once;
#: * above that, the nucleus is first looked for among the FIRST_LOOK most likely tokens, which is
#:   all a peaked row (the usual case for a real draft model) costs: ``topk(256)`` took 23 us at
#:   8,192 entries and 43 us at 16,384, a radix sort 79 and 155 us;
#: * a flat row then gets the radix sort up to RADIX_VOCAB entries, and a top-k of the cap above,
#:   where a radix pass costs more (3.2 ms at 131,072 entries, ``topk(4096)`` 1.0 ms).
RADIX_FIRST = 4096
RADIX_VOCAB = 16384
FIRST_LOOK = 256


def descending(probs: np.ndarray) -> np.ndarray:
    """The indices of ``probs`` (1-D, finite, >= 0; as float32) from the most likely down; ties keep
    index order. (A NaN would sort first and a negative value by its magnitude: a distribution has
    neither.)

    A least-significant-digit radix sort on the float32 bit patterns, which order like the values
    for non-negative floats: a stable sort on the low 16 bits, then on the high 16. NumPy sorts
    16-bit keys stably by counting, so each pass is linear in the vocabulary.
    """
    keys = ~(np.ascontiguousarray(probs, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF))
    by_low = np.argsort((keys & np.uint32(0xFFFF)).astype(np.uint16), kind="stable")
    return by_low[np.argsort((keys[by_low] >> np.uint32(16)).astype(np.uint16), kind="stable")]


def _most_likely(probs: torch.Tensor, nucleus: Nucleus, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the most likely tokens in order: at least the nucleus, at most ``cap``."""
    vocab = probs.shape[-1]
    if vocab > RADIX_FIRST:
        values, ids = probs.topk(min(FIRST_LOOK, cap))
        if float(values.cumsum(0)[-1]) >= np.float32(nucleus.mass) or values.shape[0] >= cap:
            return values, ids  # a peaked row, or a cap within the first look
        if vocab > RADIX_VOCAB:
            return probs.topk(cap)
    table = probs.numpy()
    order = descending(table)[:cap]
    return torch.from_numpy(table[order]), torch.from_numpy(order.astype(np.int64))


def cut(probs: torch.Tensor, nucleus: Nucleus) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus of one distribution ``probs [V]``: (ids int64, float16 weights), most likely first.

    Entries that are 0 (removed by the request's top-k/top-p) or round to 0 in float16 are left out;
    being the least likely, they are the nucleus's tail.
    """
    probs = probs.detach().to("cpu", torch.float32).contiguous()
    values, ids = _most_likely(probs, nucleus, min(nucleus.max_entries, probs.shape[-1]))
    mass = values.cumsum(0).numpy()
    keep = int(np.searchsorted(mass, np.float32(nucleus.mass), side="left")) + 1  # compared in float32, as summed
    weights = values[:keep].half()
    keep = int(torch.count_nonzero(weights))
    return ids[:keep], weights[:keep]


def pack(ids: torch.Tensor, weights: torch.Tensor) -> SparseQ:
    """The wire form of a nucleus (ids as little-endian uint32, weights as float16)."""
    return SparseQ(ids=ids.numpy().astype("<u4").tobytes(), probs=weights.numpy().astype("<f2").tobytes())


def _parse(q: SparseQ) -> tuple[np.ndarray, np.ndarray]:
    """(uint32 ids, float64 weights) as sent, unchecked: the one place that decodes the bytes."""
    return np.frombuffer(q.ids, dtype="<u4"), np.frombuffer(q.probs, dtype="<f2").astype(np.float64)


def read(q: SparseQ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64, q float64) from the wire: the exact distribution the drafter sampled from."""
    ids, weights = _parse(q)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(weights / weights.sum())


def _scatter(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(vocab, dtype=torch.float32).index_put_((ids,), probs.float())


def draft_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                nucleus: Nucleus) -> tuple[int, SparseQ]:
    """Sample one draft token for a sampled request from the nucleus of its distribution."""
    ids, weights = cut(probs_from_logits(logits, params), nucleus)
    token = int(ids[sample(weights, gen)])
    return token, pack(ids, weights)


def guess_token(logits: torch.Tensor, params: SamplingParams, race: tuple[int, int]) -> int:
    """Guess the verifier's coupled bonus token (``shared.coupling``): the winner of the race keyed
    by ``race`` = (key, round) over the request's full distribution. No draw from the drafting
    stream, and no q: a guess is never sent as a draft (the verifier's own token replaces it)."""
    return race_winner(probs_from_logits(logits, params), *race)


@dataclass(frozen=True)
class CheckedQ:
    """A wire q that passed :func:`check`, parsed once: the distribution the draft came from."""

    ids: torch.Tensor  # int64
    probs: torch.Tensor  # float64, normalised
    token_prob: float  # q(drafted token)

    def dense(self, vocab: int) -> torch.Tensor:
        return _scatter(self.ids, self.probs, vocab)


def check(q: SparseQ, token: int, vocab: int) -> CheckedQ:
    """Refuse a wire q that cannot be what ``token`` was sampled from; returns it parsed.

    Runs once per draft position on the verifier's event loop, so it stays in numpy: a few
    vectorised passes over the entries, no sort.
    """
    if len(q.ids) % 4 or len(q.probs) % 2 or len(q.ids) // 4 != len(q.probs) // 2:
        raise DraftError(f"q has {len(q.ids)} id bytes but {len(q.probs)} probability bytes")
    ids, weights = _parse(q)
    if ids.size == 0:
        raise DraftError("q is empty; it must list at least the drafted token")
    if int(ids.max()) >= vocab or not 0 <= token < vocab:
        raise DraftError(f"a token id in the draft or its q is outside the vocabulary of {vocab}")
    seen = np.zeros(vocab, dtype=bool)
    seen[ids] = True
    if int(seen.sum()) != ids.size:
        raise DraftError("q lists a token id twice")
    if not bool(((weights >= 0) & (weights <= 1)).all()):  # also refuses NaN
        raise DraftError("q has a probability outside [0, 1]")
    mass = float(weights.sum())
    if not 0.0 < mass <= 1.0 + Q_MASS_TOLERANCE or not math.isfinite(mass):
        raise DraftError(f"q's probabilities sum to {mass:.6f}; they must sum to at most 1")
    at = np.flatnonzero(ids == token)
    if at.size == 0 or weights[at[0]] <= 0.0:
        raise DraftError(f"drafted token {token} has probability 0 under its own q")
    probs = weights / mass
    return CheckedQ(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(probs), float(probs[at[0]]))


def dense(q: SparseQ, vocab: int) -> torch.Tensor:
    """A checked wire q as a dense float32 vector over the vocabulary."""
    return _scatter(*read(q), vocab)
