"""Batch-invariant attention grouped by key block: still attention, bitwise a one-row step's, and
never reading a key no step wrote (the arena is ``torch.empty``; an aligned slot's padding rows
are zeroed once before they are read)."""

from __future__ import annotations

import pytest
import torch

from shared.runner import KVArena, KVError, KVShape, KVSlot, ModelRunner, Segment
from shared.runner.invariant import (
    KEY_BLOCK,
    block_keys,
    clear_key_padding,
    group_rows,
    grouped_attention,
    probe_attention_multiple,
)
from shared.runner.step import paged_attention, plan_step, write_kv
from tests.unit.runner_models import KV_BUDGET, tiny_model, token_ids

CPU = torch.device("cpu")
SHAPE = KVShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


@pytest.mark.parametrize(("length", "keys"), [(1, 16), (15, 16), (16, 16), (17, 32), (128, 128), (129, 144)])
def test_a_row_attends_over_its_length_rounded_up_to_a_block(length: int, keys: int) -> None:
    assert KEY_BLOCK == 16 and block_keys(length) == keys


def test_rows_are_grouped_by_block_and_padded_to_the_multiple() -> None:
    a, b = KVSlot(start=0, capacity=32, length=13), KVSlot(start=32, capacity=16, length=0)
    plan = plan_step([Segment(a, [1, 2, 3, 4, 5], 0), Segment(b, [6], 0)], 1, torch.float32, CPU)
    grouped = group_rows(plan.spans, 4, kv_heads=2, heads_per_kv=3, dtype=torch.float32, device=CPU)
    # a's new rows see 14..18 keys: 14, 15, 16 in block 16; 17, 18 in block 32; b's row sees 1
    assert [(g.kv_start, g.keys, g.first, g.rows) for g in grouped.groups] == [(0, 16, 0, 4), (0, 32, 4, 4),
                                                                               (32, 16, 8, 4)]
    assert grouped.padded_rows == 12 and grouped.index.numel() == 6 * 2
    assert [m.shape for m in grouped.masks] == [(4 * 3, 16), (4 * 3, 32), (4 * 3, 16)]
    visible = [(m == 0).sum(1).view(4, 3)[:, 0].tolist() for m in grouped.masks]  # keys each padded row sees
    assert visible == [[14, 15, 16, 1], [17, 18, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize(("heads", "kv_heads", "multiple"), [(4, 4, 1), (4, 2, 2), (6, 2, 4), (4, 1, 8)])
def test_grouped_attention_matches_paged_attention(heads: int, kv_heads: int, multiple: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + multiple)
    dim = 8
    kv = torch.randn(2, kv_heads, 160, dim, generator=gen)  # finite past every length: masks decide
    slots = [KVSlot(start=0, capacity=48, length=13), KVSlot(start=48, capacity=16, length=0),
             KVSlot(start=64, capacity=96, length=70)]
    news = [6, 9, 1]
    plan = plan_step([Segment(s, list(range(n)), 0) for s, n in zip(slots, news, strict=True)],
                     heads // kv_heads, torch.float32, CPU)
    total = sum(news)
    q = torch.randn(total, heads, dim, generator=gen)
    k, v = torch.randn(total, kv_heads, dim, generator=gen), torch.randn(total, kv_heads, dim, generator=gen)
    write_kv(kv, plan, k, v)
    grouped = group_rows(plan.spans, multiple, kv_heads, heads // kv_heads, torch.float32, CPU)
    torch.testing.assert_close(grouped_attention(q, kv, grouped, 0.3), paged_attention(q, kv, plan, kv_heads, 0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_probe_finds_an_attention_multiple_here(dtype: torch.dtype) -> None:
    """0 would be correct too (row by row), but slow: on this CI's CPUs the grouped path must be taken."""
    assert probe_attention_multiple(3, 3, 64, dtype, CPU) in (1, 2, 4, 8)


def test_key_padding_is_zeroed_once_and_only_where_no_step_wrote() -> None:
    arena = KVArena(SHAPE, 64 * SHAPE.bytes_per_token, align=KEY_BLOCK)
    arena.data.fill_(float("nan"))
    slot = arena.allocate(20)
    assert slot is not None and slot.capacity == 32
    clear_key_padding([Segment(slot, [1, 2, 3], 0)], arena)
    rows = arena.data[:, :, :, slot.start : slot.start + 32]
    assert rows[..., :3, :].isnan().all() and (rows[..., 3:16, :] == 0).all()  # the step writes rows 0..2
    assert rows[..., 16:, :].isnan().all() and slot.finite == 16
    rows[..., :3, :] = 7.0  # what the step wrote
    slot.length = 3
    clear_key_padding([Segment(slot, list(range(15)), 0)], arena)  # up to 18 keys: block 32
    assert (rows[..., :3, :] == 7).all() and (rows[..., 3:16, :] == 0).all()
    assert rows[..., 16:18, :].isnan().all() and (rows[..., 18:, :] == 0).all()  # the step writes 16, 17
    assert slot.finite == 32
    rows[..., 18:, :] = 5.0  # rolled-back drafts' rows: finite, masked, left alone
    slot.length = 18
    clear_key_padding([Segment(slot, [1], 0)], arena)
    assert (rows[..., 18:, :] == 5).all()


def test_an_aligned_arena_rounds_slots_up_and_its_size_down() -> None:
    arena = KVArena(SHAPE, 70 * SHAPE.bytes_per_token, align=16)
    assert arena.tokens == 64
    slot = arena.allocate(17)
    assert slot is not None and slot.capacity == 32
    assert arena.fits(32) and not arena.fits(33)
    with pytest.raises(KVError, match="16 at a time"):
        KVArena(SHAPE, 15 * SHAPE.bytes_per_token, align=16)
    source, copy = arena.allocate(1), arena.allocate(8)
    assert source is not None and copy is not None and source.capacity == copy.capacity == 16
    source.length = 5
    arena.share(source, copy, 5)
    assert copy.finite == 5  # shared rows are finite


def test_an_arena_full_of_nan_changes_no_logit() -> None:
    """Fresh arena pages hold whatever was there; the masked keys past a row's length must weigh 0."""
    loaded = tiny_model("llama")
    ids = token_ids(40, seed=11)
    got = []
    for fill in (0.0, float("nan")):
        runner = ModelRunner(loaded, 8 * KV_BUDGET, kind="lean", batch_invariant=True,
                             fuse=False)  # fused blocks attend row by row: no key blocks to pad
        assert runner.attention_multiple > 0
        runner.kv.data.fill_(fill)
        slot = runner.kv.allocate(len(ids))
        assert slot is not None
        rows = [runner.forward([Segment(slot, ids[i : i + w], 0)]) for i, w in ((0, 9), (9, 1), (10, 23), (33, 7))]
        got.append(torch.cat([r for r in rows if r is not None]))
    assert got[1].isfinite().all() and torch.equal(got[0], got[1])
