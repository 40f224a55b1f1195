"""Sampling-aware drafting's q: the nucleus cut, its wire form, and the verifier's checks."""

from __future__ import annotations

import math

import pytest
import torch

from shared.draft_q import RADIX_VOCAB, DraftError, Nucleus, check, cut, dense, descending, draft_token, pack, read
from shared.protocol import SamplingParams, SparseQ
from shared.sampling import make_generator, probs_from_logits

V = 64


def _probs(seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale, -1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("mass", "max_entries"), [(1.0, V), (0.99, 1024), (0.9, 1024), (0.5, 1024), (1.0, 8),
                                                   (0.99, 1)])
def test_cut_keeps_the_most_likely_tokens_until_the_mass_or_the_cap(seed: int, mass: float,
                                                                      max_entries: int) -> None:
    probs = _probs(seed)
    ids, weights = cut(probs, Nucleus(mass, max_entries))
    order = probs.argsort(descending=True)
    assert ids.tolist() == order[: len(ids)].tolist()  # the most likely first, in order
    assert len(ids) <= max_entries
    kept = float(probs[ids].sum())
    if len(ids) < max_entries:  # stopped by the mass: the smallest prefix that reaches it
        assert kept >= mass - 1e-6
        assert float(probs[ids[:-1]].sum()) < mass
    torch.testing.assert_close(weights.double(), probs[ids].double(), atol=1e-3, rtol=1e-3)


def test_cut_leaves_out_what_the_request_truncated() -> None:
    probs = probs_from_logits(torch.randn(V, generator=torch.Generator().manual_seed(1)),
                              SamplingParams(temperature=1.0, top_k=5))
    ids, _ = cut(probs, Nucleus(1.0, 4096))
    assert len(ids) == 5


@pytest.mark.parametrize("seed", range(4))
def test_wire_round_trip_is_the_sampled_distribution(seed: int) -> None:
    ids, weights = cut(_probs(seed), Nucleus(0.95, 32))
    q = SparseQ(**{f: getattr(pack(ids, weights), f) for f in ("ids", "probs")})
    got_ids, got = read(q)
    assert got_ids.tolist() == ids.tolist()
    want = weights.double() / weights.double().sum()
    assert torch.equal(got, want)  # bit-exact: the verifier reads the q the drafter sampled from
    assert len(q.ids) == 4 * len(ids) and len(q.probs) == 2 * len(ids)  # 6 bytes per entry
    token = int(ids[0])
    checked = check(q, token, V)
    assert checked.token_prob == float(want[0])
    assert torch.equal(checked.dense(V), dense(q, V))
    assert float(dense(q, V).sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("mass", [1.0, 0.99, 0.9, 0.7])
def test_acceptance_loses_at_most_the_mass_left_out(mass: float) -> None:
    """sum(min(p, q_cut)) >= sum(min(p, q)) - (1 - kept mass): what the issue's bound promises."""
    for seed in range(8):
        p, q = _probs(100 + seed), _probs(200 + seed, scale=1.5)
        ids, weights = cut(q, Nucleus(mass, 4096))
        q_cut = dense(pack(ids, weights), V).double()
        full = float(torch.minimum(p.double(), q.double()).sum())
        kept = float(q[ids].sum())
        assert float(torch.minimum(p.double(), q_cut).sum()) >= full - (1 - kept) - 1e-3


def test_draft_token_samples_exactly_the_nucleus() -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gen = make_generator(7, "draft")
    n = 20000
    counts = torch.zeros(V)
    for _ in range(n):
        token, q = draft_token(logits, params, gen, Nucleus(0.9, 16))
        counts[token] += 1
    ids, want = read(q)
    assert set(counts.nonzero().flatten().tolist()) <= set(ids.tolist())
    for i, w in zip(ids.tolist(), want.tolist(), strict=True):
        assert abs(counts[i].item() / n - w) <= 5 * math.sqrt(w * (1 - w) / n) + 1e-9


def _q(ids: list[int], probs: list[float]) -> SparseQ:
    return SparseQ(ids=torch.tensor(ids, dtype=torch.int32).numpy().astype("<u4").tobytes(),
                   probs=torch.tensor(probs, dtype=torch.float16).numpy().tobytes())


@pytest.mark.parametrize(
    ("q", "token", "fragment"),
    [
        (_q([1, 2], [0.7, 0.7]), 1, "at most 1"),
        (_q([1, 1], [0.5, 0.5]), 1, "twice"),
        (_q([1, 2], [1.0, 0.0]), 2, "probability 0"),
        (_q([1, 2], [0.5, 0.5]), 3, "probability 0"),  # drafted token not listed at all
        (_q([1, V + 3], [0.5, 0.5]), 1, "outside the vocabulary"),
        (_q([1, 2], [0.5, 0.5]), V, "outside the vocabulary"),
        (_q([1, 2], [1.5, -0.5]), 1, "outside [0, 1]"),
        (_q([1, 2], [float("nan"), 1.0]), 1, "outside [0, 1]"),
        (_q([1, 2], [0.0, 0.0]), 1, "at most 1"),
        (SparseQ(ids=b"\x01\0\0\0\x02\0\0\0", probs=b"\0\x3c"), 1, "probability bytes"),
        (SparseQ(ids=b"\x01\0\0", probs=b"\0\x3c"), 1, "probability bytes"),
    ],
)
def test_check_refuses_a_q_that_cannot_be_what_was_sampled(q: SparseQ, token: int, fragment: str) -> None:
    with pytest.raises(DraftError, match=fragment.replace("[", r"\[")):
        check(q, token, V)


def test_a_partial_nucleus_is_accepted_and_renormalised() -> None:
    q = _q([3, 0], [0.6, 0.3])
    assert check(q, 3, V).token_prob == pytest.approx(0.6 / 0.9, rel=1e-3)
    assert float(dense(q, V)[3]) == pytest.approx(0.6 / 0.9, rel=1e-3)


@pytest.mark.parametrize(("mass", "entries"), [(0.0, 4), (1.01, 4), (0.9, 0), (0.9, 4097)])
def test_nucleus_settings_validated(mass: float, entries: int) -> None:
    with pytest.raises(ValueError, match="nucleus"):
        Nucleus(mass, entries)


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0, 12.0])  # from flat (a full sort) to peaked (a partial top-k)
@pytest.mark.parametrize(("mass", "max_entries"), [(0.98, 4096), (0.5, 4096), (0.999, 100), (1.0, 300)])
@pytest.mark.parametrize("vocab", [2000, RADIX_VOCAB - 1000, RADIX_VOCAB + 1000])  # radix; top-k then radix; top-k
def test_cut_equals_the_nucleus_of_the_fully_sorted_distribution(scale: float, mass: float, max_entries: int,
                                                                  vocab: int) -> None:
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * scale, -1)
    ordered, order = probs.sort(descending=True)
    cap = min(max_entries, vocab)
    keep = min(cap, int((ordered.cumsum(0) < mass).sum()) + 1)
    ids, weights = cut(probs, Nucleus(mass, max_entries))
    want = order[:keep][ordered[:keep].half() > 0]
    assert torch.equal(probs[ids], probs[want])  # the same values in the same order; ties may swap ids
    assert len(set(ids.tolist())) == len(ids)
    assert torch.equal(weights, probs[want].half())


@pytest.mark.parametrize("seed", range(6))
def test_descending_is_an_exact_stable_sort_from_the_most_likely(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(3000, generator=gen) * (1 + 4 * seed), -1)
    probs[torch.randint(0, 3000, (200,), generator=gen)] = 0.0  # zeros (a request's top-k or top-p)
    probs[100:140] = probs[7]  # ties
    probs[141] = -0.0  # the sign bit must not make a zero the most likely
    probs[142] = 1e-42  # a float32 subnormal
    want = torch.sort(probs.abs(), descending=True, stable=True).indices
    assert descending(probs.numpy()).tolist() == want.tolist()
