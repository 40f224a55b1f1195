"""Alternative lookaheads: drafting ahead for "draft j rejected, the runner-up committed instead"
in a spare KV cache of the session (``proposers/draft_cache.py``, ``lookahead.py``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.drafter.batcher import DraftBatcher
from services.drafter.lookahead import BRANCH_MIN_ODDS, ODDS_PRIOR, BranchOdds, Lookahead
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import Continuation, DraftJob, JobSession, Proposal
from services.drafter.proposers.draft_cache import SPARE_IDLE_COMMITS, KVCache, SessionCaches
from services.drafter.proposers.draft_model import DraftModelProposer
from services.drafter.worker import ComputeWorker
from shared.models import LoadedModel, load_model
from shared.protocol import MAX_DRAFT_TOKENS, SamplingParams
from shared.runner import ModelRunner
from shared.runner.kv import KVArena, KVShape
from shared.runner.runner import kv_shape
from tests.unit.draft_proposer_support import (
    FULL_GREEDY,
    PROMPT,
    K,
    gen,
    make,
    outcomes,
    reference_greedy,
    reference_logits,
    verdict,
)

torch.set_num_threads(1)

GREEDY = FULL_GREEDY


@pytest.fixture(scope="module")
def draft(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["draft-L1"])


@contextlib.asynccontextmanager
async def running(proposer: DraftModelProposer) -> AsyncIterator[tuple[DraftBatcher, DrafterMetrics]]:
    metrics = DrafterMetrics()
    batcher = DraftBatcher(proposer, ComputeWorker(inline=True), metrics)
    task = asyncio.create_task(batcher.run())
    try:
        yield batcher, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def second_choice(model: LoadedModel, ids: list[int]) -> int:
    return int(reference_logits(model, ids).topk(2).indices[1])


# --- the proposer ----------------------------------------------------------------------------


def test_a_greedy_draft_names_each_tokens_runner_up(draft: LoadedModel) -> None:
    p = make(draft)
    p.start("s", PROMPT, 64)
    (prop,) = p.propose([DraftJob(JobSession("s", GREEDY, gen(0)), K)])
    assert prop.token_ids == reference_greedy(draft, PROMPT, K)
    assert prop.runner_up == [second_choice(draft, PROMPT + prop.token_ids[:j]) for j in range(K)]


def test_a_sampled_draft_names_no_runner_up(draft: LoadedModel) -> None:
    p = make(draft)
    p.start("s", PROMPT, 64)
    (prop,) = p.propose([DraftJob(JobSession("s", SamplingParams(temperature=1.0, max_tokens=64), gen(0)), K)])
    assert len(prop.token_ids) == K and prop.runner_up == []


@pytest.mark.parametrize("j", [0, 1, 3])
def test_a_branch_drafts_what_a_fresh_cache_drafts_and_becomes_the_main_cache_when_it_comes_true(
        draft: LoadedModel, j: int) -> None:
    p = make(draft)
    p.start("s", PROMPT, 64)
    (sent,) = p.propose([DraftJob(JobSession("s", GREEDY, gen(0)), K)])
    up = sent.runner_up[j]
    assume = (*sent.token_ids[:j], up)
    main, branch = p.propose([DraftJob(JobSession("s", GREEDY, gen(0)), K + 1,
                                       after=Continuation(tuple(sent.token_ids), len(PROMPT))),
                              DraftJob(JobSession("s", GREEDY, gen(0)), K, after=Continuation(assume, len(PROMPT),
                                                                                              branch=1))])
    assert main.token_ids == reference_greedy(draft, PROMPT + sent.token_ids, K + 1)  # the main cache is untouched
    assert branch.token_ids == reference_greedy(draft, [*PROMPT, *assume], K)
    # the verifier rejects draft j in favour of the runner-up: the branch's cache is kept
    p.commit("s", list(assume), j)
    caches = p._sessions["s"].caches
    assert caches.main is not None and caches.main.cached[: len(PROMPT) + j + 1] == [*PROMPT, *assume]
    assert p.cached_tokens("s") == len(PROMPT) + j + K  # the branch's drafts are in it (the last one unfed)
    (nxt,) = p.propose([DraftJob(JobSession("s", GREEDY, gen(0)), K)])
    assert nxt.token_ids == branch.token_ids == reference_greedy(draft, [*PROMPT, *assume], K)


def test_a_branch_copies_only_the_rows_its_spare_lacks(draft: LoadedModel) -> None:
    arena = KVArena(KVShape(1, 1, 2, torch.float32), 1 << 20)
    slot = arena.allocate(32)
    assert slot is not None
    arena.data[:, :, :, slot.start : slot.start + 10] = 7.0
    slot.length = 10
    caches = SessionCaches(arena, KVCache(slot, list(range(10))))
    spare = caches.for_job(1, [*range(6), 99])  # drafts 0..5 accepted, then 99
    assert spare is not None and spare.cached == list(range(6)) and spare.slot.length == 6
    assert bool((arena.data[:, :, :, spare.slot.start : spare.slot.start + 6] == 7.0).all())
    arena.data[:, :, :, spare.slot.start : spare.slot.start + 6] = 3.0  # mark the spare's rows
    again = caches.for_job(1, [*range(8), 42])
    assert again is spare and spare.cached == list(range(8))
    assert bool((arena.data[:, :, :, spare.slot.start : spare.slot.start + 6] == 3.0).all())  # not copied again
    assert bool((arena.data[:, :, :, spare.slot.start + 6 : spare.slot.start + 8] == 7.0).all())


def test_spares_give_way_to_sessions_and_are_freed_when_no_longer_used(draft: LoadedModel) -> None:
    runner = ModelRunner(draft, 300 * kv_shape(draft.model).bytes_per_token, self_check=False)  # 300 tokens
    p = DraftModelProposer(runner, draft.eos_ids)
    new_tokens = 100 - len(PROMPT) - MAX_DRAFT_TOKENS  # a slot of 100 tokens
    p.start("a", PROMPT, new_tokens)
    (sent,) = p.propose([DraftJob(JobSession("a", GREEDY, gen(0)), K)])
    p.propose([DraftJob(JobSession("a", GREEDY, gen(0)), K, after=Continuation((sent.runner_up[0],), len(PROMPT),
                                                                               branch=1))])
    assert len(p._sessions["a"].caches.spares) == 1
    # a second spare would leave no room for another session: refused, the job drafts nothing
    (none,) = p.propose([DraftJob(JobSession("a", GREEDY, gen(0)), K, after=Continuation((sent.runner_up[1],),
                                                                                         len(PROMPT), branch=2))])
    assert none.token_ids == [] and len(p._sessions["a"].caches.spares) == 1
    p.start("b", PROMPT, new_tokens)
    p.start("c", PROMPT, new_tokens)  # needs the spare's rows: the spare gives way
    assert not p._sessions["c"].disabled and not p._sessions["a"].caches.spares
    p.close("a")
    p.close("c")
    (sent,) = p.propose([DraftJob(JobSession("b", GREEDY, gen(0)), K)])
    p.propose([DraftJob(JobSession("b", GREEDY, gen(0)), K, after=Continuation((sent.runner_up[0],), len(PROMPT),
                                                                               branch=1))])
    assert len(p._sessions["b"].caches.spares) == 1 and runner.kv.sessions == 2
    for _ in range(SPARE_IDLE_COMMITS + 1):  # rounds without a branch job: the session stopped drafting ahead
        p.commit("b", [sent.token_ids[0]], 1)
    assert not p._sessions["b"].caches.spares and runner.kv.sessions == 1


# --- the lookahead ----------------------------------------------------------------------------


@pytest.mark.parametrize("came_true", [True, False])
@pytest.mark.asyncio
async def test_the_verdict_keeps_the_alternative_whose_rejection_came_true(draft: LoadedModel, came_true: bool) -> None:
    p = make(draft)
    p.start("s", PROMPT, 64)
    lookahead = Lookahead()
    async with running(p) as (batcher, metrics):
        sent, _, _ = await batcher.propose(DraftJob(JobSession("s", GREEDY, gen(0)), K))
        alternatives = [(1, sent.runner_up[1]), (2, sent.runner_up[2])]
        lookahead.start(batcher, DraftJob(JobSession("s", GREEDY, gen(0)), K + 1,
                                          after=Continuation(tuple(sent.token_ids), len(PROMPT))),
                        alternatives)
        correction = sent.runner_up[2] if came_true else (sent.runner_up[2] + 1) % draft.vocab_size
        tokens = [*sent.token_ids[:2], correction]
        # as the session runner does: settle first (the verdict may come before the branch has
        # drafted anything: settle waits for it), then commit
        await lookahead.settle(verdict(tokens, 2), K, metrics)
        p.commit("s", tokens, 2)
        ready = lookahead.take(K)
        expected = reference_greedy(draft, PROMPT + tokens, K)
        if came_true:
            assert ready is not None and ready.token_ids == expected and len(ready.runner_up) == K
            assert lookahead.asked == K  # the round taking it asked the proposer for its K tokens
            assert outcomes(metrics) == {"used": 1.0, "missed": 0.0, "dropped": 0.0}
            assert metrics.registry.get_sample_value("specfleet_drafter_alternative_lookaheads_used_total") == 1.0
            # the branch's cache is now the session's: it holds the correction and the ready draft
            # but its last token, so the next lookahead feeds only that one
            assert p.cached_tokens("s") == len(PROMPT) + len(tokens) + K - 1
            look, _, _ = await batcher.propose(DraftJob(JobSession("s", GREEDY, gen(0)), K + 1,
                                                        after=Continuation(tuple(expected), len(PROMPT) + len(tokens))))
            assert look.token_ids == reference_greedy(draft, PROMPT + tokens + expected, K + 1)
        else:
            assert ready is None and outcomes(metrics) == {"used": 0.0, "missed": 1.0, "dropped": 0.0}
        fresh, _, _ = await batcher.propose(DraftJob(JobSession("s", GREEDY, gen(0)), K))
        assert fresh.token_ids == expected  # whichever cache is kept, the next round is argmax decoding


@pytest.mark.asyncio
async def test_a_rejection_without_an_alternative_drops_every_lookahead(draft: LoadedModel) -> None:
    p = make(draft)
    p.start("s", PROMPT, 64)
    lookahead = Lookahead()
    async with running(p) as (batcher, metrics):
        sent, _, _ = await batcher.propose(DraftJob(JobSession("s", GREEDY, gen(0)), K))
        lookahead.start(batcher, DraftJob(JobSession("s", GREEDY, gen(0)), K + 1,
                                          after=Continuation(tuple(sent.token_ids), len(PROMPT))),
                        [(2, sent.runner_up[2])])
        tokens = [sent.runner_up[0]]  # rejected at 0: no branch assumed that
        p.commit("s", tokens, 0)
        await lookahead.settle(verdict(tokens, 0), K, metrics)
        assert lookahead.take(K) is None and outcomes(metrics) == {"used": 0.0, "missed": 0.0, "dropped": 1.0}
        fresh, _, _ = await batcher.propose(DraftJob(JobSession("s", GREEDY, gen(0)), K))
        assert fresh.token_ids == reference_greedy(draft, PROMPT + tokens, K)


# --- which alternatives -----------------------------------------------------------------------


def _sent(tokens: list[int], ups: list[int]) -> Proposal:
    return Proposal(token_ids=tokens, runner_up=ups)


@pytest.mark.parametrize(("verdicts", "n", "picked"), [
    ([], 2, [(0, 10), (1, 11)]),  # nothing observed: every position at the prior, earliest first
    ([([1, 2, 12], 2)] * 5, 1, [(2, 12)]),  # rejections at 2 in favour of the runner-up: 2 first
    ([([1, 2, 12], 2)] * 5 + [([10], 0)] * 10, 2, [(0, 10), (2, 12)]),
    ([([1, 2, 99], 2)] * 5, 1, [(0, 10)]),  # rejected at 2, but not for the runner-up: no hit there
    ([([1, 2, 3, 4, 5], 4)] * 5, 4, [(0, 10), (1, 11), (2, 12), (3, 13)]),  # all accepted: no hits anywhere
    ([([1, 2, 3, 4, 5], 4)] * 30, 4, []),  # ... for long: no alternative is worth its row
    ([([1, 2, 3, 4, 5], 4)] * 30 + [([10], 0)] * 8, 4, [(0, 10)]),  # until one comes true often again
])
def test_branch_odds_pick_the_likeliest_rejections(verdicts: list[tuple[list[int], int]], n: int,
                                                   picked: list[tuple[int, int]]) -> None:
    odds = BranchOdds()
    sent = _sent([1, 2, 3, 4], [10, 11, 12, 13])
    for tokens, accepted in verdicts:
        odds.observe(sent, verdict(tokens, accepted), 4)
    assert odds.pick(sent, n) == picked


def test_branch_odds_skip_a_missing_or_useless_runner_up() -> None:
    odds = BranchOdds()
    assert odds.pick(_sent([1, 2], []), 2) == []  # a sampled draft
    assert odds.pick(_sent([1, 2], [-1, 2]), 2) == []  # no second choice; a runner-up equal to the draft
    assert odds.pick(_sent([1, 2], [5, 6]), 0) == []
    odds.observe(_sent([1, 2], [5, 6]), verdict([5], 0, finished=True), 2)
    assert odds.rate == {}  # a final verdict teaches nothing
    assert BRANCH_MIN_ODDS <= ODDS_PRIOR < 1  # an unobserved position is branched
