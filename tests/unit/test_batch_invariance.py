"""Batch invariance: a position's logits are bitwise the same whatever step computed them.

Every Llama-family variant of the runner tests, in float32 and bfloat16: the same sequence is
scored one token per step alone, then in steps of mixed widths beside other sessions (decoding,
verifying, prefilling), and every logit must be equal bit for bit. The grouped attention must
also still be attention: it matches transformers' forward to rounding.
"""

from __future__ import annotations

import pytest
import torch

from shared.models import ModelLoadError
from shared.runner import ModelRunner, Segment
from shared.runner.invariant import probe_row_multiples
from tests.unit.runner_models import ARCHS, KV_BUDGET, assert_close, full_logits, tiny_model, token_ids

DTYPES = [torch.float32, torch.bfloat16]
#: (widths of the session's steps, what else shares each step: (tokens, logits wanted) per neighbour)
PATTERNS = {
    "rounds": ([3, 1, 5, 8, 2, 6, 4, 7, 8], [(1, True)]),
    "beside-prefill": ([5, 5, 5, 5, 5, 5, 5, 5, 4], [(13, False), (1, True)]),
    "one-wide-step": ([44], []),
    "alone-chunks": ([2, 9, 1, 16, 3, 13], []),
}


def invariant_runner(arch: str, dtype: torch.dtype) -> ModelRunner:
    loaded = tiny_model(arch)
    loaded.model.to(dtype)
    return ModelRunner(loaded, 8 * KV_BUDGET, kind="lean", batch_invariant=True)


def one_token_steps(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    slot = runner.kv.allocate(len(ids))
    assert slot is not None
    rows = [runner.forward([Segment(slot, [t], 0)]) for t in ids]
    runner.kv.free(slot)
    return torch.cat([r for r in rows if r is not None])


def mixed_steps(runner: ModelRunner, ids: list[int], widths: list[int], beside: list[tuple[int, bool]]
                ) -> torch.Tensor:
    slot = runner.kv.allocate(len(ids))
    others = [runner.kv.allocate(len(ids) * 4) for _ in beside]
    assert slot is not None and all(o is not None for o in others)
    fed, got = 0, []
    for width in widths:
        segments = [Segment(o, token_ids(n, seed=fed + i), 0 if wants else n)  # type: ignore[arg-type]
                    for i, (o, (n, wants)) in enumerate(zip(others, beside, strict=True))]
        segments.append(Segment(slot, ids[fed : fed + width], 0))
        rows = runner.forward(segments)
        assert rows is not None
        got.append(rows[-width:])
        fed += width
    for s in [slot, *others]:
        runner.kv.free(s)  # type: ignore[arg-type]
    assert fed == len(ids)
    return torch.cat(got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_are_bitwise_the_same_whatever_the_step(arch: str, dtype: torch.dtype) -> None:
    runner = invariant_runner(arch, dtype)
    ids = token_ids(44, seed=3)
    alone = one_token_steps(runner, ids)
    for name, (widths, beside) in PATTERNS.items():
        got = mixed_steps(runner, ids, widths, beside)
        diff = (got != alone).any(-1).nonzero().flatten().tolist()
        assert not diff, f"{name}: positions {diff} differ from one-token steps"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_invariant_runner_still_computes_the_model(arch: str) -> None:
    loaded = tiny_model(arch)
    reference = full_logits(loaded.model, token_ids(70, seed=5))  # crosses a 64-key block
    runner = ModelRunner(loaded, 8 * KV_BUDGET, kind="lean", batch_invariant=True)
    got = mixed_steps(runner, token_ids(70, seed=5), [30, 1, 5, 34], [(2, True)])
    assert_close(got, reference)


def test_a_rolled_back_draft_leaves_no_trace() -> None:
    """Rejected drafts' rows stay in the slot past its length; later steps must not see them."""
    runner = invariant_runner("llama", torch.float32)
    ids = token_ids(20, seed=7)
    alone = one_token_steps(runner, ids)
    slot = runner.kv.allocate(40)
    assert slot is not None
    runner.forward([Segment(slot, ids[:10], 10)])
    runner.forward([Segment(slot, [ids[10], *token_ids(6, seed=8)], 0)])  # 6 drafts, all rejected
    slot.truncate(11)
    rows = runner.forward([Segment(slot, ids[11:], 0)])
    assert rows is not None and torch.equal(rows, alone[11:])


def test_the_hf_runner_cannot_be_invariant() -> None:
    with pytest.raises(ModelLoadError, match="batch invariance needs the lean runner"):
        ModelRunner(tiny_model("llama"), KV_BUDGET, kind="hf", batch_invariant=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_probe_finds_a_row_multiple_here(dtype: torch.dtype) -> None:
    shapes = [(64, 96), (96, 64), (64, 300), (64, 96)]
    multiples = probe_row_multiples(shapes, dtype, torch.device("cpu"))
    assert list(multiples) == [(64, 96), (96, 64), (64, 300)]  # each shape once
    assert all(m in (1, 2, 4, 8, 16, 32) for m in multiples.values())
