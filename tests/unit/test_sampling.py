"""Sampling: logits -> the exact distribution sampled from, and parameter validation.

Both the drafter (q) and the verifier (p) rely on probs_from_logits, so its truncation rules
are checked against brute-force definitions on random rows.
"""

from __future__ import annotations

import pytest
import torch

from shared import sampling
from shared.protocol import SamplingParams
from shared.sampling import (
    SamplingError,
    is_greedy,
    make_generator,
    probs_from_logit_rows,
    probs_from_logits,
    sample,
    validate,
)


def _logits(seed: int, rows: int = 8, vocab: int = 50) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3.0  # continuous: ties have probability 0


def test_greedy_is_one_hot_on_argmax() -> None:
    logits = _logits(0)
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(logits.shape[0]))
    assert int((probs > 0).sum()) == logits.shape[0]
    assert is_greedy(SamplingParams(temperature=0.0)) and not is_greedy(SamplingParams(temperature=0.5))


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 2.0])
def test_temperature_scales_logits(temperature: float) -> None:
    logits = _logits(1)
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))


def test_lower_temperature_sharpens() -> None:
    logits = _logits(2)
    cold = probs_from_logits(logits, SamplingParams(temperature=0.3)).max(-1).values
    hot = probs_from_logits(logits, SamplingParams(temperature=1.7)).max(-1).values
    assert bool((cold > hot).all())


def test_half_precision_logits_are_computed_in_float32() -> None:
    probs = probs_from_logits(_logits(3).half(), SamplingParams(temperature=0.8))
    assert probs.dtype == torch.float32


@pytest.mark.parametrize("k", [1, 2, 5, 49])
def test_top_k_keeps_exactly_k_highest(k: int) -> None:
    logits = _logits(4)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    kept = probs > 0
    assert torch.equal(kept.sum(-1), torch.full((logits.shape[0],), k))
    top = torch.topk(logits, k, -1).indices
    assert bool(kept.gather(-1, top).all())
    # Inside the kept set the ratios are unchanged: it is the softmax restricted to the top k.
    expected = torch.softmax(logits.masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("k", [0, 50, 1000])
def test_top_k_zero_or_at_least_vocab_disables_it(k: int) -> None:
    logits = _logits(5)
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
    assert bool((probs > 0).all())


def _minimal_nucleus_size(row: torch.Tensor, top_p: float) -> int:
    """Brute force: the smallest n whose n most likely tokens carry at least top_p of the mass."""
    ordered = sorted(row.tolist(), reverse=True)
    mass = 0.0
    for n, prob in enumerate(ordered, start=1):
        mass += prob
        if mass >= top_p - 1e-6:
            return n
    return len(ordered)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_top_p_keeps_the_minimal_nucleus(top_p: float, temperature: float) -> None:
    logits = _logits(6)
    full = torch.softmax(logits / temperature, -1)
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature, top_p=top_p))
    for row_full, row in zip(full, probs, strict=True):
        kept = row > 0
        n = int(kept.sum())
        assert n >= 1
        assert n == _minimal_nucleus_size(row_full, top_p)
        # The kept tokens are the n most likely ones, renormalised.
        assert set(torch.topk(row_full, n).indices.tolist()) == set(kept.nonzero().flatten().tolist())
        torch.testing.assert_close(row[kept], row_full[kept] / row_full[kept].sum())


def _vocab_rows() -> torch.Tensor:
    """Rows of a 49,152-token vocabulary, peaked to flat: nuclei of one token to thousands."""
    torch.manual_seed(11)
    return torch.randn(24, 49_152) * torch.linspace(0.3, 14.0, 24).unsqueeze(1)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_top_p_over_the_near_candidates_keeps_what_sorting_the_whole_row_keeps(
        top_p: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nucleus is looked for among the tokens within NUCLEUS_SPAN of the largest logit, and a row whose
    candidates carry less than top_p is sorted whole: bitwise the distribution sorting every row gives."""
    rows = _vocab_rows()
    fast = probs_from_logit_rows(rows, [1.0] * 24, [0] * 24, [top_p] * 24)
    monkeypatch.setattr(sampling, "NUCLEUS_SPAN", float("inf"))  # every token a candidate: the whole row sorted
    assert torch.equal(fast, probs_from_logit_rows(rows, [1.0] * 24, [0] * 24, [top_p] * 24))
    for row, got in zip(rows, fast, strict=True):  # float32's mass against float64's: exact where the nucleus is small
        if (want := _minimal_nucleus_size(torch.softmax(row, -1), top_p)) < 200:
            assert int((got > 0).sum()) == want


def test_a_nucleus_past_the_near_candidates_is_found_by_sorting_the_row() -> None:
    """One token 10.5 logits above a thousand others holds 0.973 of the mass: top_p 0.99 needs some of them."""
    row = torch.full((1, 4096), -1e4)
    row[0, 0], row[0, 1:1001] = 0.0, -10.5
    probs = probs_from_logits(row, SamplingParams(temperature=1.0, top_p=0.99))
    assert int((probs > 0).sum()) == _minimal_nucleus_size(torch.softmax(row[0], -1), 0.99) > 1


def test_each_rows_distribution_is_the_one_it_gets_alone() -> None:
    """Rows of mixed settings in one batch (top-p, top-k, both, neither) get what each gets alone."""
    rows = _vocab_rows()
    temperature = [1.0, 0.7] * 12
    top_k = [0, 0, 40, 40, 0, 2000] * 4
    top_p = [0.9, 1.0, 1.0, 0.8, 0.95, 0.99] * 4
    batch = probs_from_logit_rows(rows, temperature, top_k, top_p)
    for i in range(24):
        alone = probs_from_logit_rows(rows[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        assert torch.equal(batch[i : i + 1], alone)


def test_top_p_always_keeps_at_least_one_token() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.equal((probs > 0).sum(-1), torch.tensor([1, 1]))


def test_top_k_then_top_p_applies_nucleus_to_the_renormalised_top_k() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top_k=2 leaves [0.4, 0.3] -> renormalised [0.571, 0.429]; top_p=0.5 then keeps only the first.
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_seeded_sampling_is_reproducible() -> None:
    probs = torch.softmax(_logits(7)[0], -1)
    a = [sample(probs, g) for g in [make_generator(42, "verify")] for _ in range(20)]
    b = [sample(probs, g) for g in [make_generator(42, "verify")] for _ in range(20)]
    assert a == b
    assert make_generator(None, "draft").initial_seed() != make_generator(None, "draft").initial_seed()


@pytest.mark.parametrize("seed", [0, 1, 42, 2**63 - 1, -5])
def test_a_seeded_requests_streams_are_distinct_and_reproducible(seed: int) -> None:
    draft, verify = make_generator(seed, "draft"), make_generator(seed, "verify")
    assert draft.initial_seed() != verify.initial_seed()
    assert draft.initial_seed() == make_generator(seed, "draft").initial_seed()
    assert torch.rand(4, generator=draft).tolist() != torch.rand(4, generator=verify).tolist()


def test_unknown_stream_refused() -> None:
    with pytest.raises(ValueError, match="unknown random stream"):
        make_generator(1, "drafter")


def test_sample_never_draws_a_zero_probability_token() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    gen = make_generator(0, "verify")
    assert {sample(probs, gen) for _ in range(200)} == {1, 3}


@pytest.mark.parametrize(
    ("params", "prompt_len", "max_model_len", "param", "fragment"),
    [
        (SamplingParams(temperature=2.5), 4, 64, "temperature", "temperature must be in [0, 2]"),
        (SamplingParams(temperature=-0.1), 4, 64, "temperature", "temperature must be in [0, 2]"),
        (SamplingParams(top_p=0.0), 4, 64, "top_p", "top_p must be in (0, 1]"),
        (SamplingParams(top_p=1.5), 4, 64, "top_p", "top_p must be in (0, 1]"),
        (SamplingParams(top_k=-1), 4, 64, "top_k", "top_k must be >= 0"),
        (SamplingParams(max_tokens=0), 4, 64, "max_tokens", "max_tokens must be >= 1"),
        (SamplingParams(max_tokens=8), 64, 64, "messages", "Shorten the prompt"),
        (SamplingParams(max_tokens=8), 100, 64, "messages", "Shorten the prompt"),
        (SamplingParams(max_tokens=61), 4, 64, "max_tokens", "ask for at most 60 tokens"),
    ],
)
def test_validate_refuses_with_param_name(
    params: SamplingParams, prompt_len: int, max_model_len: int, param: str, fragment: str
) -> None:
    with pytest.raises(SamplingError) as info:
        validate(params, prompt_len, max_model_len)
    assert info.value.param == param
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.0, max_tokens=60), SamplingParams(temperature=2.0, top_p=1.0)],
)
def test_validate_accepts_servable_requests(params: SamplingParams) -> None:
    validate(params, prompt_len=4, max_model_len=64)


@pytest.mark.parametrize("temperature", [1e-40, 1e-9, 1e-6])
def test_tiny_temperature_is_greedy_not_nan(temperature: float) -> None:
    logits = torch.tensor([[3.0, 1.0, 2.9, -5.0]]) * 100
    probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    assert probs.argmax().item() == 0 and probs.max().item() == pytest.approx(1.0)
