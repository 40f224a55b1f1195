"""The accept/reject math is lossless: proved by exact enumeration, then checked by sampling.

Model of the target used here: one fixed distribution row P[t] per output position t, the same
whatever tokens came before (position-dependent but history-independent). Real targets condition
on history, but the verifier's rule acts on one position at a time given the prefix, so a
history-independent p is the general case for each fixed prefix and lets us write the target's
joint law of the first two output tokens as P[0](a) * P[1](b).

The drafter's side: at position t it chooses x from a distribution D[t]; the verifier is told
q[t] (dense or sparse: q == D) or nothing (ids-only: q is one-hot on x, whatever D was).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable

import pytest
import torch

from shared.acceptance import accept_probability, one_hot, residual, verify_greedy, verify_sampled
from shared.sampling import make_generator

V = 5
N_OUT = 2  # output tokens whose joint law is checked
QFn = Callable[[int, int], torch.Tensor | None]  # (position, drafted token) -> q row told to the verifier


# --- greedy --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("draft", "argmax", "expected"),
    [
        ([4, 7, 1], [4, 7, 1, 9], (3, 9)),  # all accepted -> the bonus token
        ([4, 7, 1], [5, 7, 1, 9], (0, 5)),  # first rejected -> the target's own token
        ([4, 7, 1], [4, 2, 1, 9], (1, 2)),  # middle mismatch: later agreement does not count
        ([4, 7, 1], [4, 7, 3, 9], (2, 3)),  # last mismatch
        ([], [6], (0, 6)),  # empty draft: one target token per round
        ([0], [0, 0], (1, 0)),  # repeated token ids
    ],
    ids=["all-accepted", "first-rejected", "middle-mismatch", "last-mismatch", "empty-draft", "repeats"],
)
def test_verify_greedy(draft: list[int], argmax: list[int], expected: tuple[int, int]) -> None:
    assert verify_greedy(draft, argmax) == expected


@pytest.mark.parametrize("seed", range(5))
def test_sampled_with_one_hot_target_equals_greedy(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, V, (4,), generator=rng).tolist()
    draft = [argmax[0], argmax[1] if seed % 2 else (argmax[1] + 1) % V, argmax[2]]
    p = torch.stack([one_hot(t, V) for t in argmax])
    assert verify_sampled(draft, p, None, make_generator(seed, "verify")) == verify_greedy(draft, argmax)


# --- exact enumeration -----------------------------------------------------------------------------------


def _rows(gen: torch.Generator, n: int, zeros: int = 0) -> torch.Tensor:
    """n random distributions over V in float64; ``zeros`` entries per row forced to 0 (truncation)."""
    rows = torch.rand(n, V, generator=gen, dtype=torch.float64) + 0.05
    for r in range(n):
        if zeros:
            rows[r, torch.randperm(V, generator=gen)[:zeros]] = 0.0
    return rows / rows.sum(-1, keepdim=True)


def exact_output_law(p: torch.Tensor, d: torch.Tensor, q_fn: QFn, k: int) -> dict[tuple[int, ...], float]:
    """Exact law of the first N_OUT output tokens when every round drafts k tokens.

    Walks every draft token under D, both the accept and reject branch (with the probabilities
    accept_probability and residual give), and the bonus token, across rounds until N_OUT tokens
    are out. The position of the next token is always the number of tokens already out.
    """
    law: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(out: tuple[int, ...], j: int, weight: float) -> None:
        if len(out) == N_OUT:
            law[out] += weight
            return
        pos = len(out)
        if j == k:  # every draft accepted: the bonus token from p
            for t in range(V):
                if p[pos, t] > 0:
                    walk((*out, t), 0, weight * float(p[pos, t]))
            return
        for x in range(V):
            dx = float(d[pos, x])
            if dx == 0.0:
                continue
            q = q_fn(pos, x)
            q = one_hot(x, V).double() if q is None else q
            a = accept_probability(p[pos], q, x)
            if a > 0:
                walk((*out, x), j + 1, weight * dx * a)
            if a < 1:
                r = residual(p[pos], q)
                for t in range(V):
                    if r[t] > 0:
                        walk((*out, t), 0, weight * dx * (1 - a) * float(r[t]))

    walk((), 0, 1.0)
    return law


def _scenario(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, QFn]:
    """(p rows, drafter's D rows, what the verifier is told) for one kind of drafter."""
    gen = torch.Generator().manual_seed(seed)
    p = _rows(gen, N_OUT, zeros=seed % 2)  # odd seeds: the target itself is truncated (top-k/top-p)
    if kind == "dense":
        d = _rows(gen, N_OUT)
        return p, d, lambda pos, x: d[pos]
    if kind == "sparse":
        d = _rows(gen, N_OUT, zeros=2)
        return p, d, lambda pos, x: d[pos]
    if kind == "ids-only-sampled":
        return p, _rows(gen, N_OUT), lambda pos, x: None
    if kind == "ids-only-greedy":  # the drafter's argmax of its own (different) distribution
        d = torch.stack([one_hot(int(r.argmax()), V).double() for r in _rows(gen, N_OUT)])
        return p, d, lambda pos, x: None
    if kind == "q-equals-p":  # rejection has probability 0: the residual's fallback path
        return p, p, lambda pos, x: p[pos]
    raise AssertionError(kind)


KINDS = ["dense", "sparse", "ids-only-sampled", "ids-only-greedy", "q-equals-p"]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_exact_law_of_first_two_tokens_is_the_targets(kind: str, k: int, seed: int) -> None:
    p, d, q_fn = _scenario(kind, seed)
    law = exact_output_law(p, d, q_fn, k)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)
    for a, b in itertools.product(range(V), repeat=2):
        assert law.get((a, b), 0.0) == pytest.approx(float(p[0, a] * p[1, b]), abs=1e-6), (a, b)
    first = [sum(law.get((a, b), 0.0) for b in range(V)) for a in range(V)]
    assert first == pytest.approx(p[0].tolist(), abs=1e-6)


def test_residual_is_normalised_positive_part() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.2, 0.1], dtype=torch.float64)
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(residual(p, p), p)


@pytest.mark.parametrize(("px", "qx", "expected"), [(0.2, 0.4, 0.5), (0.4, 0.2, 1.0), (0.0, 0.3, 0.0), (0.3, 0.0, 1.0)])
def test_accept_probability(px: float, qx: float, expected: float) -> None:
    p = torch.tensor([px, 1 - px])
    q = torch.tensor([qx, 1 - qx])
    assert accept_probability(p, q, 0) == pytest.approx(expected)


# --- Monte Carlo of verify_sampled itself ----------------------------------------------------------------


def _simulate(p: torch.Tensor, d: torch.Tensor, send_q: bool, k: int, n: int, seed: int) -> Counter[tuple[int, ...]]:
    """Run rounds of verify_sampled until N_OUT tokens are out, n times; count the outputs."""
    drafter = torch.Generator().manual_seed(seed)
    verifier = make_generator(seed + 1, "verify")
    rows = torch.cat([p, p[-1:].expand(k, V)]).float()  # bonus rows past N_OUT are never reached
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(n):
        out: list[int] = []
        while len(out) < N_OUT:
            pos = len(out)
            draft = [int(torch.multinomial(d[pos + j], 1, generator=drafter)) if pos + j < N_OUT else 0
                     for j in range(k)]
            q = [d[min(pos + j, N_OUT - 1)].float() for j in range(k)] if send_q else None
            accepted, extra = verify_sampled(draft, rows[pos : pos + k + 1], q, verifier)
            out += [*draft[:accepted], extra]
        counts[tuple(out[:N_OUT])] += 1
    return counts


@pytest.mark.parametrize(("kind", "send_q"), [("ids-only-sampled", False), ("sparse", True)])
def test_verify_sampled_matches_target_by_sampling(kind: str, send_q: bool) -> None:
    n = 12_000
    p, d, _ = _scenario(kind, seed=3)
    counts = _simulate(p, d.double(), send_q, k=2, n=n, seed=11)
    for a, b in itertools.product(range(V), repeat=2):
        expected = float(p[0, a] * p[1, b])
        sigma = math.sqrt(expected * (1 - expected) / n)
        assert abs(counts[(a, b)] / n - expected) <= 5 * sigma + 1e-9, (a, b, counts[(a, b)] / n, expected)
    for a in range(V):
        freq = sum(counts[(a, b)] for b in range(V)) / n
        expected = float(p[0, a])
        assert abs(freq - expected) <= 5 * math.sqrt(expected * (1 - expected) / n) + 1e-9
