"""The vLLM backend's pure parts: rounds over continuous decoding, and draft alignment in the proposer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from services.verifier.config import VerifierConfig
from services.verifier.main import build
from services.verifier.vllm_engine.plugin import InboxProposer, align, expand_batch_to_tokens, external_id
from services.verifier.vllm_engine.rounds import LiveSession
from shared.acceptance import matched
from shared.config import ConfigError, from_flags
from shared.protocol import MAX_CONDITIONAL_DRAFTS

# --- align: what the proposer still proposes after the request moved on ------------------------


@pytest.mark.parametrize(("context", "base", "draft", "limit", "want"), [
    ([1, 2, 3], 3, [7, 8, 9], 4, [7, 8, 9]),  # on time: the whole draft
    ([1, 2, 3], 3, [7, 8, 9], 2, [7, 8]),  # clipped to vLLM's K
    ([1, 2, 3, 7], 3, [7, 8, 9], 4, [8, 9]),  # late by one token that the draft guessed
    ([1, 2, 3, 7, 8], 3, [7, 8, 9], 4, [9]),
    ([1, 2, 3, 7, 8, 9], 3, [7, 8, 9], 4, []),  # all of it committed already
    ([1, 2, 3, 6], 3, [7, 8, 9], 4, []),  # vLLM decoded something else: dead
    ([1, 2, 3, 7, 5], 3, [7, 8, 9], 4, []),
    ([1, 2], 3, [7, 8], 4, []),  # rests on a base the request has not reached (never happens; harmless)
    ([1, 2, 3], 3, [], 4, []),
    ([1, 2, 3], 3, [7], 0, []),
])
def test_align(context: list[int], base: int, draft: list[int], limit: int, want: list[int]) -> None:
    assert align(context, base, draft, limit) == want


@pytest.mark.parametrize(("internal", "external"), [
    ("req-1-a1B2c3D4", "req-1"), ("abc-00000000", "abc"), ("plain", "plain"), ("x-short", "x-short"),
])
def test_external_id(internal: str, external: str) -> None:
    assert external_id(internal) == external


class _Batch:
    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids


class _Runner:
    def __init__(self, req_ids: list[str]) -> None:
        self.input_batch = _Batch(req_ids)


class _Spec:
    num_speculative_tokens = 3


class _Config:
    speculative_config = _Spec()


def proposer(req_ids: list[str]) -> InboxProposer:
    p = InboxProposer.__new__(InboxProposer)  # without the CPU patch, which needs vLLM
    p.k, p.runner, p.drafts, p.proposed = 3, _Runner(req_ids), {}, 0
    return p


def test_proposer_proposes_aligned_drafts_per_row_and_forgets_dead_ones() -> None:
    p = proposer(["a-00000000", "b-11111111", "c-22222222"])
    p.put([("a", 2, [5, 6, 7, 8]), ("b", 2, [9, 9]), ("c", 2, [1])], forget=[])
    tokens = np.array([[0, 0, 5, 0, 0], [0, 0, 4, 0, 0], [0, 0, 0, 0, 0]])
    out = p.propose([[5], [4], []], np.array([3, 3, 2]), tokens)
    assert out == [[6, 7, 8], [], []]  # a: late by one guessed token; b: dead; c: mid-prefill row
    assert "b" not in p.drafts and p.drafts["a"] == (3, [6, 7, 8]) and p.proposed == 3
    p.put([], forget=["a"])
    assert p.propose([[1], [1], [1]], np.array([4, 4, 4]), tokens) == [[], [], []]


def test_proposer_without_a_bound_runner_proposes_nothing() -> None:
    p = proposer([])
    p.runner = None
    p.put([("a", 0, [1])], [])
    assert p.propose([[1]], np.array([1]), np.zeros((1, 4), dtype=np.int64)) == [[]]


def test_cpu_fix_expands_like_repeat_interleave() -> None:
    x, cu = torch.tensor([0.5, 2.0, 1.0]), torch.tensor([1, 1, 4])  # the middle request has no drafts
    assert expand_batch_to_tokens(x, cu, 4).tolist() == [0.5, 1.0, 1.0, 1.0]


# --- rounds over continuous decoding ----------------------------------------------------------


def session(budget: int = 3, speculative: bool = True) -> LiveSession:
    return LiveSession("r", prompt_len=4, speculative=speculative, budget=budget)


@pytest.mark.parametrize(("draft", "tokens", "want"), [
    ([1, 2, 3], [1, 2, 9], 2), ([1, 2], [1, 2, 3], 2), ([], [5], 0), ([4], [5, 4], 0), ([1, 2], [1], 1),
])
def test_matched(draft: list[int], tokens: list[int], want: int) -> None:
    assert matched(draft, tokens) == want


@pytest.mark.parametrize(("draft", "pending", "due", "accepted"), [
    (None, [], False, 0),
    (None, [5, 6, 7], False, 0),  # no draft yet, but a late one could still propose something
    (None, [5, 6, 7, 8], True, 0),  # more decoded than the budget: no draft can help any more
    ([5, 6, 7], [5, 6], False, 2),  # the draft is still alive
    ([5, 6, 7], [5, 9], True, 1),  # rejected at its second token
    ([5, 6, 7], [5, 6, 7, 1], True, 3),  # all accepted, plus the target's token
    ([5, 6, 7], [5, 6, 7], True, 3),  # decoded past a late draft that guessed it all: nothing left to propose
    ([], [5], True, 0),  # an empty draft: the round ends with the next token
])
def test_when_a_round_ends(draft: list[int] | None, pending: list[int], due: bool, accepted: int) -> None:
    s = session()
    if draft is not None:
        assert s.take_draft(0, draft, now=1.0)
    s.pending = list(pending)
    assert s.due() is due
    if due:
        done = s.resolve(now=2.0)
        assert (done.accepted, done.tokens, done.round, done.base) == (accepted, pending, 0, 0)
        assert s.round == 1 and s.published == pending and s.pending == [] and s.draft is None
        assert s.base_len == 4 + len(pending)


def test_target_only_and_budget_zero_rounds_end_at_every_token() -> None:
    for s in (session(speculative=False), session(budget=0)):
        assert not s.due()
        s.pending = [3]
        assert s.due()


def test_stale_duplicate_and_over_budget_drafts() -> None:
    s = session(budget=2)
    assert not s.take_draft(1, [1], now=0.0)  # a round that has not begun
    assert s.take_draft(0, [1, 2, 3, 4], now=0.5)
    assert s.draft == [1, 2]  # clipped to the budget
    assert not s.take_draft(0, [1], now=0.6)  # one draft per round
    s.pending = [1, 2, 3]
    s.resolve(now=1.0)
    assert not s.take_draft(0, [9], now=1.1)  # its round already ended: ignored, not an error


def test_a_live_draft_survives_tokens_it_guessed() -> None:
    s = session(budget=4)
    s.pending = [7]  # vLLM decoded one token while the draft travelled
    assert s.take_draft(0, [7, 8, 9], now=0.0)
    assert s.live_draft() == [7, 8, 9] and not s.due()
    s.pending += [8, 1]
    assert s.live_draft() is None and s.due()
    assert s.resolve(now=1.0).accepted == 2


# --- conditional drafts (Draft.after) ---------------------------------------------------------


def after_round_zero(committed: list[int], budget: int = 3) -> LiveSession:
    """A session whose round 0 committed ``committed``; round 1 is current."""
    s = session(budget=budget)
    s.pending = list(committed)
    s.resolve(now=1.0)
    return s


@pytest.mark.parametrize(("round_", "after", "have_draft", "want"), [
    (2, (9,), False, "held"),  # for the next round: kept until this one ends
    (1, (5, 6), False, "taken"),  # its round began committing exactly its after: it is that round's draft
    (1, (5, 7), False, "dropped"),  # the round it assumed came out otherwise
    (1, (5, 6), True, "dropped"),  # the round has its draft already
    (0, (), False, "dropped"),  # a round long gone
    (3, (9,), False, "dropped"),  # too far ahead
])
def test_a_conditional_draft_on_arrival(round_: int, after: tuple[int, ...], have_draft: bool, want: str) -> None:
    s = after_round_zero([5, 6])
    if have_draft:
        assert s.take_draft(1, [1], now=1.5)
    assert s.offer(round_, after, [1, 2, 3, 4], now=2.0) == want
    assert (s.upcoming.held == [(after, [1, 2, 3, 4])]) is (want == "held")
    if want == "taken":
        assert s.draft == [1, 2, 3] and s.draft_wait_s == pytest.approx(1.0)  # clipped; waited since round 1 began


@pytest.mark.parametrize(("committed", "budget", "speculative", "taken", "dropped", "draft"), [
    ([5, 6], 3, True, True, 1, [7, 8, 9]),  # the draft after (5, 6) begins round 1, clipped to its budget
    ([5, 6], 1, True, True, 1, [7]),
    ([5, 9], 3, True, False, 2, None),  # neither came true
    ([5, 6], 0, True, False, 2, None),  # no budget: no draft
    ([5, 6], 3, False, False, 2, None),  # target-only from now on
])
def test_the_next_round_begins_with_the_draft_that_came_true(
        committed: list[int], budget: int, speculative: bool, taken: bool, dropped: int,
        draft: list[int] | None) -> None:
    s = session()
    assert s.offer(1, (5, 6), [7, 8, 9, 10], now=0.5) == "held"
    assert s.offer(1, (5, 7), [1, 1], now=0.6) == "held"
    s.pending = list(committed)
    s.resolve(now=1.0)
    s.budget, s.speculative = budget, speculative
    assert s.promote() == (taken, dropped)
    assert s.draft == draft and s.upcoming.held == []
    if taken:
        assert s.draft_wait_s == 0.0 and s.live_draft() == draft and not s.due()


def test_a_session_holds_only_so_many_conditional_drafts() -> None:
    s = session()
    fates = [s.offer(1, (i,), [i], now=0.0) for i in range(MAX_CONDITIONAL_DRAFTS + 1)]
    assert fates == ["held"] * MAX_CONDITIONAL_DRAFTS + ["dropped"]


# --- configuration errors are caught before vLLM starts ----------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    ({"backend": "tensorrt"}, "--backend must be one of torch, vllm"),
    ({"backend": "vllm", "batching": "wisp"}, "--batching, --trim and --recompute-context apply to the torch"),
    ({"backend": "vllm", "trim": "adaspec"}, "--batching, --trim and --recompute-context apply to the torch"),
    ({"backend": "vllm", "recompute_context": True}, "--batching, --trim and --recompute-context apply to the torch"),
])
def test_backend_flags_that_cannot_work_are_refused(flags: dict[str, str], message: str,
                                                    tiny_models: dict[str, Path]) -> None:
    cfg = from_flags(VerifierConfig, model=str(tiny_models["target"]), **flags)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ConfigError, match=message):
            build(cfg, loop)
    finally:
        loop.close()
