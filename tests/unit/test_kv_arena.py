"""The KV arena (first-fit ranges, coalescing, accounting) and the packed step layout."""

from __future__ import annotations

import pytest
import torch

from shared.runner import KVArena, KVError, KVShape, KVSlot, Segment
from shared.runner.step import commit_step, paged_attention, plan_step, write_kv

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)  # 2 * 2 * 2 * 4 * 4 = 128 bytes a token


def arena(tokens: int = 100, extra_bytes: int = 0) -> KVArena:
    return KVArena(SHAPE, tokens * SHAPE.bytes_per_token + extra_bytes)


def take(kv: KVArena, tokens: int) -> KVSlot:
    slot = kv.allocate(tokens)
    assert slot is not None, f"no room for {tokens} tokens"
    return slot


# --- shapes and budget -------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "itemsize"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_bytes_per_token(dtype: torch.dtype, itemsize: int) -> None:
    shape = KVShape(layers=3, kv_heads=2, head_dim=16, dtype=dtype)
    assert shape.bytes_per_token == 3 * 2 * 2 * 16 * itemsize
    kv = KVArena(shape, 10 * shape.bytes_per_token)
    assert kv.data.dtype == dtype
    assert kv.data.element_size() * kv.data[:, :, :, :1].numel() == shape.bytes_per_token  # one token's rows


def test_budget_rounds_down_to_whole_tokens() -> None:
    kv = arena(100, extra_bytes=SHAPE.bytes_per_token - 1)
    assert kv.tokens == 100
    assert kv.budget_bytes == 100 * SHAPE.bytes_per_token
    assert kv.data.shape == (2, 2, 2, 100, 4)  # [layers, k/v, kv_heads, tokens, head_dim]
    assert (kv.sessions, kv.reserved_tokens, kv.cached_tokens, kv.largest_free) == (0, 0, 0, 100)


def test_a_budget_below_one_token_is_refused() -> None:
    with pytest.raises(KVError, match="holds no token"):
        KVArena(SHAPE, SHAPE.bytes_per_token - 1)
    assert KVArena(SHAPE, SHAPE.bytes_per_token).tokens == 1


def test_release_gives_the_memory_back_and_refuses_every_slot_after() -> None:
    kv = arena(100)
    take(kv, 10)
    kv.release()
    assert kv.data.numel() == 0
    assert kv.allocate(1) is None and kv.largest_free == 0 and kv.sessions == 0


# --- allocation --------------------------------------------------------------------------


def test_allocation_is_first_fit() -> None:
    kv = arena(100)
    a, b, c = take(kv, 10), take(kv, 20), take(kv, 30)
    assert [(s.start, s.capacity, s.length) for s in (a, b, c)] == [(0, 10, 0), (10, 20, 0), (30, 30, 0)]
    kv.free(b)  # a hole of 20 at 10, and 40 free at 60
    assert take(kv, 25).start == 60  # the hole is too small
    assert take(kv, 5).start == 10  # the first range that fits, not the best one
    assert take(kv, 15).start == 15  # exactly the rest of the hole
    assert take(kv, 15).start == 85
    assert kv.allocate(1) is None and kv.largest_free == 0


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1)])
def test_freed_ranges_coalesce_with_both_neighbours(order: tuple[int, int, int]) -> None:
    kv = arena(100)
    slots = [take(kv, 20), take(kv, 30), take(kv, 10)]  # and 40 free at the end
    for i in order:
        kv.free(slots[i])
    assert kv.largest_free == 100 and kv.sessions == 0
    assert take(kv, 100).start == 0  # one range again


def test_free_merges_with_previous_and_next_ranges() -> None:
    kv = arena(60)
    a, b, c, d = take(kv, 10), take(kv, 10), take(kv, 10), take(kv, 10)
    kv.free(a)
    kv.free(c)
    assert kv.largest_free == 20  # 10 at 0, 10 at 20, 20 at 40: nothing merged yet
    kv.free(b)  # joins the range before (a) and the range after (c)
    assert kv.largest_free == 30
    assert take(kv, 30).start == 0
    kv.free(d)  # joins the free tail
    assert kv.largest_free == 30 and take(kv, 30).start == 30


def test_fragmentation_refuses_a_range_that_only_fits_in_total() -> None:
    kv = arena(100)
    quarters = [take(kv, 25) for _ in range(4)]
    kv.free(quarters[0])
    kv.free(quarters[2])
    assert kv.tokens - kv.reserved_tokens == 50  # 50 free in total
    assert kv.largest_free == 25
    assert not kv.fits(30) and kv.fits(25)
    assert kv.allocate(30) is None  # no contiguous range: hold the session, do not raise
    kv.free(quarters[1])  # 0..75 is one range now
    assert kv.fits(75) and not kv.fits(76)
    assert take(kv, 30).start == 0


@pytest.mark.parametrize("tokens", [0, -1])
def test_a_slot_needs_at_least_one_token(tokens: int) -> None:
    with pytest.raises(KVError, match="at least one token"):
        arena().allocate(tokens)


def test_a_request_larger_than_the_arena_can_never_be_served() -> None:
    kv = arena(100)
    with pytest.raises(KVError, match="can never fit"):
        kv.allocate(101)
    whole = take(kv, 100)  # the whole arena is fine
    assert kv.allocate(1) is None  # full now: no room, but not an error
    kv.free(whole)
    assert kv.fits(100)


def test_accounting() -> None:
    kv = arena(100)
    a, b = take(kv, 30), take(kv, 12)
    a.length, b.length = 17, 12
    assert (kv.sessions, kv.reserved_tokens, kv.cached_tokens) == (2, 42, 29)
    a.truncate(5)
    assert kv.cached_tokens == 17 and a.room == 25 and b.room == 0
    kv.free(a)
    assert (kv.sessions, kv.reserved_tokens, kv.cached_tokens) == (1, 12, 12)
    assert kv.budget_bytes == 100 * 128  # the budget never changes


def test_free_is_idempotent() -> None:
    kv = arena(50)
    a, b = take(kv, 20), take(kv, 20)
    kv.free(a)
    kv.free(a)
    assert (kv.sessions, kv.reserved_tokens, kv.largest_free) == (1, 20, 20)
    # The same rows handed out again: the stale slot object must not free its successor.
    again = take(kv, 20)
    assert again.start == a.start and again is not a
    kv.free(a)
    assert kv.sessions == 2 and kv.allocate(11) is None
    kv.free(KVSlot(start=20, capacity=20))  # equal fields, but not one of this arena's slots
    assert kv.sessions == 2 and b.start == 20
    for slot in (again, b, b):
        kv.free(slot)
    assert kv.largest_free == 50 and kv.sessions == 0


def test_truncate_bounds() -> None:
    slot = KVSlot(start=5, capacity=10, length=6)
    slot.truncate(6)  # no-op
    slot.truncate(2)
    assert slot.length == 2 and slot.room == 8
    for bad in (3, -1, 11):
        with pytest.raises(KVError, match="cannot roll back"):
            slot.truncate(bad)  # only backwards, never below 0
    slot.truncate(0)
    assert slot.length == 0


# --- the step layout ---------------------------------------------------------------------


def test_plan_step_layout() -> None:
    a, b = KVSlot(start=40, capacity=10, length=3), KVSlot(start=0, capacity=8, length=0)
    p = plan_step([Segment(a, [7], 0), Segment(b, [4, 5, 6], 1)], 2, torch.float32, torch.device("cpu"))
    assert p.input_ids.tolist() == [7, 4, 5, 6]
    assert p.positions.tolist() == [3, 0, 1, 2]
    assert p.write_rows.tolist() == [43, 0, 1, 2]
    assert p.logit_rows is not None and p.logit_rows.tolist() == [0, 2, 3]
    assert p.rows_wanted == 3
    first, second = p.spans
    assert (first.q_start, first.n, first.kv_start, first.kv_len, first.mask) == (0, 1, 40, 4, None)
    assert (second.q_start, second.n, second.kv_start, second.kv_len) == (1, 3, 0, 3)
    assert second.mask is not None and second.mask.shape == (2 * 3, 3)  # rows (group, token)
    causal = torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(torch.isinf(second.mask), causal.repeat(2, 1))
    assert (a.length, b.length) == (3, 0)  # planning does not commit
    commit_step([Segment(a, [7], 0), Segment(b, [4, 5, 6], 1)])
    assert (a.length, b.length) == (4, 3)


def test_plan_step_mask_after_cached_rows() -> None:
    slot = KVSlot(start=0, capacity=10, length=4)
    p = plan_step([Segment(slot, [1, 2], 0)], 1, torch.float32, torch.device("cpu"))
    assert p.logit_rows is None and p.rows_wanted == 2  # every row wanted: no index_select
    mask = p.spans[0].mask
    assert mask is not None
    assert torch.isinf(mask).tolist() == [[False] * 5 + [True], [False] * 6]
    nothing = plan_step([Segment(slot, [1, 2], 2)], 1, torch.float32, torch.device("cpu"))
    assert nothing.rows_wanted == 0 and nothing.logit_rows is not None and nothing.logit_rows.numel() == 0


def test_plan_step_refuses_bad_segments() -> None:
    slot = KVSlot(start=0, capacity=6, length=4)
    dev = torch.device("cpu")
    with pytest.raises(KVError, match="overflows"):
        plan_step([Segment(slot, [1, 2, 3], 0)], 1, torch.float32, dev)
    plan_step([Segment(slot, [1, 2], 0)], 1, torch.float32, dev)  # exactly full is fine
    with pytest.raises(KVError, match="at least one token"):
        plan_step([Segment(slot, [], 0)], 1, torch.float32, dev)
    for logits_from in (-1, 3):
        with pytest.raises(KVError, match="logits_from"):
            plan_step([Segment(slot, [1, 2], logits_from)], 1, torch.float32, dev)
    ok = KVSlot(start=10, capacity=4)
    with pytest.raises(KVError, match="overflows"):  # one bad segment refuses the whole step
        plan_step([Segment(ok, [1], 0), Segment(slot, [1, 2, 3], 0)], 1, torch.float32, dev)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
def test_paged_attention_matches_sdpa(heads: int, kv_heads: int) -> None:
    """Packed attention over arena rows = per-session causal sdpa over [cached + new] keys."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, groups = 8, heads // kv_heads
    kv = torch.randn(2, kv_heads, 64, dim, generator=gen)  # one layer; cached rows are random
    slots = [KVSlot(start=30, capacity=12, length=5), KVSlot(start=0, capacity=9, length=0),
             KVSlot(start=50, capacity=10, length=9)]
    news = [4, 6, 1]
    segments = [Segment(s, list(range(n)), 0) for s, n in zip(slots, news, strict=True)]
    p = plan_step(segments, groups, torch.float32, torch.device("cpu"))
    total = sum(news)
    q = torch.randn(total, heads, dim, generator=gen)
    k, v = torch.randn(total, kv_heads, dim, generator=gen), torch.randn(total, kv_heads, dim, generator=gen)
    write_kv(kv, p, k, v)
    got = paged_attention(q, kv, p, kv_heads, scale=0.3)
    assert got.shape == (total, heads * dim)
    q_start = 0
    for slot, n in zip(slots, news, strict=True):
        rows = kv[:, :, slot.start : slot.start + slot.length + n]
        assert torch.equal(rows[0, :, slot.length :], k[q_start : q_start + n].transpose(0, 1))  # written in place
        keys, values = rows[0].repeat_interleave(groups, 0), rows[1].repeat_interleave(groups, 0)
        mask = torch.ones(n, slot.length + n, dtype=torch.bool).tril(slot.length)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[q_start : q_start + n].transpose(0, 1), keys, values, attn_mask=mask, scale=0.3)
        torch.testing.assert_close(got[q_start : q_start + n], want.transpose(0, 1).reshape(n, heads * dim))
        q_start += n
