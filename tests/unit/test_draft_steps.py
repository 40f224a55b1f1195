"""Continuous batching at the drafter: a stepping proposer's run (one forward at a time) lets
sessions join between forwards and hands each its draft as soon as it is done, with the same
tokens as drafting alone; a session closed mid-run leaves at the next forward; the batcher lets a
round that became ready while a batch drafts join it instead of waiting for the batch's end."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import pytest
import torch

from services.drafter.batcher import DraftBatcher
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import (
    Continuation,
    DraftJob,
    DraftRun,
    JobSession,
    Proposal,
    SteppingProposer,
)
from services.drafter.proposers.draft_model import DraftModelProposer
from services.drafter.worker import ComputeWorker
from shared.draft_q import read
from shared.models import LoadedModel
from shared.runner.kv import KVArena
from tests.unit.draft_proposer_support import BATCH_PROMPTS, GREEDY, WARM, gen, make, reference_greedy, tiny_draft

torch.set_num_threads(1)

FP16_RTOL = 2e-3  # a q's float16 probabilities (test_draft_model_proposer)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_draft(tmp_path_factory)


def job(sid: str, k: int, seed: int = 0, sampled: bool = False) -> DraftJob:
    return DraftJob(JobSession(sid, WARM if sampled else GREEDY, gen(seed)), k)


def started(draft: LoadedModel) -> DraftModelProposer:
    proposer = make(draft)
    for sid, prompt in BATCH_PROMPTS.items():
        proposer.start(sid, prompt, 64)
    return proposer


def freeing(draft: LoadedModel) -> tuple[DraftModelProposer, KVArena, int]:
    """A started proposer whose closed sessions' caches are freed (not kept for their rows), its arena,
    and how many tokens the arena held reserved before the sessions started."""
    proposer = make(draft, share_prefixes=False)
    kv = proposer.runner.kv
    assert isinstance(kv, KVArena)
    empty = kv.reserved_tokens
    for sid, prompt in BATCH_PROMPTS.items():
        proposer.start(sid, prompt, 64)
    return proposer, kv, empty


def after_each_forward(proposer: DraftModelProposer) -> asyncio.Event:
    """An event set after each of the proposer's forwards (with inline compute the test's coroutine
    then runs between two forwards, as a verdict's reader does)."""
    forwarded = asyncio.Event()
    step = proposer.step

    def counted(run: DraftRun) -> int:
        rows = step(run)
        forwarded.set()
        return rows

    proposer.step = counted  # type: ignore[method-assign]
    return forwarded


@pytest.mark.parametrize("after", [0, 1, 3])
def test_a_session_joining_a_run_drafts_what_it_drafts_alone(draft: LoadedModel, after: int) -> None:
    """"b" joins after ``after`` forwards of "a" and "c" (a sampled one among them): every draft,
    and every q, is the one of a batch of the job alone, and the short one finishes first."""
    proposer = started(draft)
    assert isinstance(proposer, SteppingProposer)
    run = proposer.begin([job("a", 6), job("c", 2, seed=3, sampled=True)])
    got: dict[str, Proposal] = {}

    def step() -> None:
        proposer.step(run)
        got.update((j.session_id, p) for j, p in run.take_finished())

    for _ in range(after):
        step()
    proposer.join(run, [job("b", 4)])
    while not run.done:
        step()
    alone = started(draft)
    for sid, j in (("a", job("a", 6)), ("c", job("c", 2, seed=3, sampled=True)), ("b", job("b", 4))):
        want = alone.propose([j])[0]
        assert got[sid].token_ids == want.token_ids
        assert (got[sid].q is None) == (want.q is None)
        for qa, qb in zip(got[sid].q or [], want.q or [], strict=True):
            (ids_a, probs_a), (ids_b, probs_b) = read(qa), read(qb)
            assert ids_a.tolist() == ids_b.tolist()
            torch.testing.assert_close(probs_a, probs_b, rtol=FP16_RTOL, atol=1e-6)
    assert got["a"].token_ids == reference_greedy(draft, BATCH_PROMPTS["a"], 6)
    assert next(iter(got)) == "c" and sorted(got) == ["a", "b", "c"]  # in the order they finished


def test_a_session_closed_mid_run_leaves_at_the_next_forward_and_frees_its_cache(draft: LoadedModel) -> None:
    proposer, kv, _ = freeing(draft)
    run = proposer.begin([job("a", 5), job("b", 5)])
    proposer.step(run)
    reserved = kv.reserved_tokens
    proposer.close("b")  # between forwards (its verdict ended the request)
    assert len(run.live) == 2 and kv.reserved_tokens == reserved  # still the run's cache
    proposer.step(run)
    assert [d.job.session_id for d in run.live] == ["a"]
    assert kv.reserved_tokens < reserved
    left = dict((j.session_id, p) for j, p in run.take_finished())
    assert len(left["b"].token_ids) == 1  # what it had when it left
    while not run.done:
        proposer.step(run)
    [(a, proposal)] = run.take_finished()
    assert a.session_id == "a" and proposal.token_ids == reference_greedy(draft, BATCH_PROMPTS["a"], 5)


def test_an_abandoned_run_gives_back_the_caches_of_its_closed_sessions(draft: LoadedModel) -> None:
    """A run cut short (the verifier link lost mid-batch): its sessions are closed, before or after
    the run is abandoned, and every cache goes back."""
    proposer, kv, empty = freeing(draft)
    run = proposer.begin([job("a", 5), job("b", 5)])
    proposer.step(run)
    proposer.close("a")  # before the abandon: it waits for the run
    proposer.abandon(run)
    assert run.done and run.take_finished() == []
    proposer.close("b")  # after it
    proposer.close("c")
    assert kv.reserved_tokens == empty


@pytest.mark.asyncio
async def test_a_round_ready_while_a_batch_drafts_joins_it(draft: LoadedModel) -> None:
    """Inline compute (the event loop blocked during each forward, as on one CPU): "b" becomes
    ready after "a"'s first forward, joins at the next one, and gets its 2 tokens while "a" still
    drafts its 6. The batcher once had it wait for "a"'s batch to end."""
    proposer = started(draft)
    metrics = DrafterMetrics()
    batcher = DraftBatcher(proposer, ComputeWorker(inline=True), metrics)
    first_forward = after_each_forward(proposer)
    task = asyncio.create_task(batcher.run())
    try:
        a = asyncio.create_task(batcher.propose(job("a", 6)))
        await first_forward.wait()
        b_proposal, b_started, b_ended = await batcher.propose(job("b", 2))
        a_proposal, a_started, a_ended = await a
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert a_started < b_started and b_ended < a_ended
    assert b_proposal.token_ids == reference_greedy(draft, BATCH_PROMPTS["b"], 2)
    assert a_proposal.token_ids == reference_greedy(draft, BATCH_PROMPTS["a"], 6)
    # 6 forwards, "b"'s 2 among them: its round took no forward of its own
    forwards = [s for m in metrics.batch_size.collect() for s in m.samples
                if s.labels.get("kind") == "round" and s.name.endswith(("_count", "_sum"))]
    assert sorted(s.value for s in forwards) == [6, 8]


@pytest.mark.asyncio
async def test_a_cancelled_batcher_abandons_its_run(draft: LoadedModel) -> None:
    """The drafter cancels its batcher when the verifier link drops mid-batch, then closes every
    session: the run is abandoned, the sessions' futures cancelled, and every cache goes back."""
    proposer, kv, empty = freeing(draft)
    batcher = DraftBatcher(proposer, ComputeWorker(inline=True), DrafterMetrics())
    first_forward = after_each_forward(proposer)
    task = asyncio.create_task(batcher.run())
    drafts = [asyncio.create_task(batcher.propose(job(sid, 8))) for sid in ("a", "b")]
    await first_forward.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.wait(drafts)
    assert all(d.cancelled() for d in drafts)
    for sid in BATCH_PROMPTS:
        proposer.close(sid)
    assert kv.reserved_tokens == empty


@pytest.mark.asyncio
async def test_no_round_joins_while_a_lookahead_waits(draft: LoadedModel) -> None:
    """A lookahead waiting for the model ends the run's joining, so that it runs within a round's
    forwards (a session may be waiting for its lookahead before its next round): "b", ready after
    the lookahead, does not join "a"'s run."""
    proposer = started(draft)
    batcher = DraftBatcher(proposer, ComputeWorker(inline=True), DrafterMetrics())
    first_forward = after_each_forward(proposer)
    task = asyncio.create_task(batcher.run())
    try:
        a = asyncio.create_task(batcher.propose(job("a", 4)))
        await first_forward.wait()
        after = Continuation(base=len(BATCH_PROMPTS["c"]), assume=(5,))
        ahead = asyncio.create_task(batcher.propose(replace(job("c", 1), after=after)))
        await asyncio.sleep(0)
        _, b_started, _ = await batcher.propose(job("b", 2))
        _, _, a_ended = await a
        _, ahead_started, ahead_ended = await ahead
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    # "b" did not join "a"'s run; the run ended, and then, rounds first, "b" and the lookahead ran
    assert a_ended <= b_started <= ahead_started <= ahead_ended
