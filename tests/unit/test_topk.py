"""The two-pass top-k: torch.topk's values, in its order, with indices that point at them; and
row_argmax: torch.argmax's answer."""

from __future__ import annotations

import pytest
import torch

from shared.runner.topk import CHUNK, MIN_CHUNKS, row_argmax, topk


@pytest.mark.parametrize(("rows", "width", "k"), [
    (1, 49152, 16),  # SmolLM2's vocabulary: the head's refinement
    (1, 49152, 2),  # the proposer's two best
    (3, 49152, 16),
    (4, 49152, 2),
    (2, 151936, 2),  # Qwen2's
    (1, 128256, 5),  # Llama 3's
    (1, 49152 + 3, 2),  # not whole chunks: torch.topk whole
    (1, (MIN_CHUNKS - 1) * CHUNK, 16),  # too narrow: torch.topk whole
    (2, 100, 1),
    (1, 49152, 49152 // CHUNK + 1),  # more than the chunks: torch.topk whole
])
def test_topk_gives_torchs_values_in_order(rows: int, width: int, k: int) -> None:
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(width + k)) * 5
    got, want = topk(logits, k), logits.topk(k, dim=-1)
    assert torch.equal(got.values, want.values)
    assert torch.equal(logits.gather(1, got.indices), got.values)
    assert all(len(set(r.tolist())) == k for r in got.indices)


def test_the_k_best_crowded_into_one_chunk_are_all_found() -> None:
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, 640:656] = torch.arange(100.0, 116.0)  # the whole top 16 in one chunk
    got = topk(logits, 16)
    assert torch.equal(got.values, logits.topk(16, dim=-1).values)
    assert got.indices[1].tolist() == list(range(655, 639, -1))


def test_a_strided_row_goes_to_torch_whole() -> None:
    logits = torch.randn(49152, 2)[:, 0].unsqueeze(0)  # not contiguous
    assert torch.equal(topk(logits, 3).values, logits.topk(3, dim=-1).values)


def test_ties_give_distinct_indices_that_depend_on_the_row_alone() -> None:
    row = torch.zeros(1, 49152)
    row[0, [7, 5000, 30000, 49151]] = 3.0  # four-way tie at the top, in different chunks
    alone = topk(row, 4)
    assert torch.equal(alone.values, torch.full((1, 4), 3.0))
    assert sorted(alone.indices[0].tolist()) == [7, 5000, 30000, 49151]
    beside = topk(torch.cat([torch.randn(2, 49152), row]), 4)
    assert torch.equal(beside.indices[2], alone.indices[0])


def _argmax_case(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 49152, generator=g)
    if name == "ties":  # the first of exact ties, as torch.argmax
        logits[:, [9, 700, 40000]] = 50.0
    elif name == "nan":  # a NaN is the largest: the first one
        logits[1, [300, 20]] = float("nan")
    elif name == "-inf":  # a row masked whole (a grammar that allows nothing)
        logits[2] = float("-inf")
    elif name == "strided":
        logits = torch.randn(49152, 5, generator=g).T
    elif name == "bfloat16":  # numpy has no bfloat16: torch.argmax itself
        logits = logits.bfloat16()
    elif name == "float64":
        logits = logits.double()
    return logits


@pytest.mark.parametrize("name", ["plain", "ties", "nan", "-inf", "strided", "bfloat16", "float64"])
def test_row_argmax_is_torchs_argmax(name: str) -> None:
    logits = _argmax_case(name)
    got = row_argmax(logits)
    assert got == logits.argmax(-1).tolist()
    assert all(type(i) is int for i in got)
    if name == "ties":
        assert got == [9] * 5
    if name == "nan":
        assert got[1] == 20
