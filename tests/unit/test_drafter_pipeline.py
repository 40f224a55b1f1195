"""The drafter's pipeline: lookahead drafting (drafting round n+1 while round n is verified), the
batcher drafting rounds before lookaheads, and StarSD's N_full / N_max estimates."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from services.drafter.batcher import DraftBatcher
from services.drafter.control.admission import make_admission
from services.drafter.control.capacity import ALPHA, WARM_ROUNDS, Capacity
from services.drafter.control.threshold import ThresholdController
from services.drafter.lookahead import Lookahead
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import Continuation, DraftJob, JobSession, Proposal
from services.drafter.proposers.draft_model import DraftModelProposer
from services.drafter.worker import ComputeWorker
from shared.draft_q import check, guess_token
from shared.models import LoadedModel, load_model
from shared.protocol import SamplingParams
from shared.runner import ModelRunner
from shared.sampling import make_generator
from tests.unit.draft_proposer_support import FULL_GREEDY, PROMPT, K, outcomes, verdict

torch.set_num_threads(1)

GREEDY = FULL_GREEDY


@pytest.fixture(scope="module")
def draft(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["draft-L1"])


def make(draft: LoadedModel) -> DraftModelProposer:
    """A proposer on its own runner and KV arena, as in test_draft_model_proposer."""
    runner = ModelRunner(draft, 4 * draft.max_model_len * 1024, self_check=False)
    return DraftModelProposer(runner, draft.eos_ids)


def gen() -> torch.Generator:
    return make_generator(0, "draft")


def reference_greedy(model: LoadedModel, ids: list[int], k: int) -> list[int]:
    """Argmax decoding with plain transformers calls, no cache: the ground truth."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(k):
            seq.append(int(model.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@contextlib.asynccontextmanager
async def running(batcher: DraftBatcher) -> AsyncIterator[DraftBatcher]:
    task = asyncio.create_task(batcher.run())
    try:
        yield batcher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Pipeline:
    """A real proposer for session "s", its inline compute worker and a batcher."""

    def __init__(self, draft: LoadedModel) -> None:
        self.proposer = make(draft)
        self.proposer.start("s", PROMPT, 64)
        self.metrics = DrafterMetrics()
        self.batcher = DraftBatcher(self.proposer, ComputeWorker(inline=True), self.metrics)
        self.committed = list(PROMPT)

    async def round(self, k: int = K) -> list[int]:
        proposal, _, _ = await self.batcher.propose(DraftJob(JobSession("s", GREEDY, gen()), k))
        return proposal.token_ids

    def look_ahead(self, lookahead: Lookahead, sent: list[int]) -> None:
        """What the session runner does right after sending ``sent``: draft k + 1 tokens past it."""
        lookahead.start(self.batcher, DraftJob(JobSession("s", GREEDY, gen()), K + 1, after=Continuation(tuple(sent),
                                                                                                         len(self.committed))))

    def commit(self, tokens: list[int], accepted: int) -> None:
        self.proposer.commit("s", tokens, accepted)
        self.committed += tokens


# --- lookahead ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_lookahead_job_drafts_what_the_next_round_drafts_if_the_guess_comes_true(
        draft: LoadedModel) -> None:
    p = Pipeline(draft)
    async with running(p.batcher):
        sent = await p.round()
        busy = p.metrics.registry.get_sample_value("specfleet_drafter_model_busy_seconds_total") or 0.0
        assert busy > 0 and p.metrics.registry.get_sample_value("specfleet_drafter_lookahead_busy_seconds_total") == 0
        look, _, _ = await p.batcher.propose(DraftJob(JobSession("s", GREEDY, gen()), K + 1,
                                                      after=Continuation(tuple(sent), len(PROMPT))))
        assert look.token_ids == reference_greedy(draft, PROMPT + sent, K + 1)
        # the lookahead's batch counts as the draft model's busy time, and apart as a lookahead's
        after = p.metrics.registry.get_sample_value("specfleet_drafter_model_busy_seconds_total") or 0.0
        ahead = p.metrics.registry.get_sample_value("specfleet_drafter_lookahead_busy_seconds_total") or 0.0
        assert ahead > 0 and ahead == pytest.approx(after - busy)
        # and their CPU seconds likewise, measured on the computing thread: never more than busy
        cpu = p.metrics.registry.get_sample_value("specfleet_drafter_model_cpu_seconds_total") or 0.0
        ahead_cpu = p.metrics.registry.get_sample_value("specfleet_drafter_lookahead_cpu_seconds_total") or 0.0
        assert 0 < ahead_cpu < cpu <= after * 1.05 + 1e-3
        # the verifier accepts every draft and adds the lookahead's first token: the next round,
        # drafted normally after that commit, is the rest of the lookahead
        p.commit([*sent, look.token_ids[0]], len(sent))
        assert await p.round(K) == look.token_ids[1:]


@pytest.mark.asyncio
async def test_a_lookahead_that_came_true_is_the_next_rounds_draft(draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        expected = reference_greedy(draft, PROMPT + sent, K + 1)
        p.look_ahead(lookahead, sent)
        tokens = [*sent, expected[0]]  # all accepted, and the verifier's token is the guessed one
        p.commit(tokens, len(sent))  # the session runner commits before it settles
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        assert outcomes(p.metrics) == {"used": 1.0, "missed": 0.0, "dropped": 0.0}
        ready = lookahead.take(K)
        assert ready is not None and ready.token_ids == expected[1:] and ready.q is None
        assert lookahead.take(K) is None  # a lookahead is used once
        # it is exactly what drafting the round now would give
        assert await p.round(K) == expected[1:]


@pytest.mark.parametrize("came_true", [True, False])
@pytest.mark.asyncio
async def test_a_sampled_lookahead_guesses_the_verifiers_raced_token_and_keeps_its_q(
        came_true: bool, draft: LoadedModel) -> None:
    """At temperature > 0 the first lookahead token is the winner of the verifier's race over the
    draft model's distribution (shared.coupling); the rest are sampled drafts with their q."""
    p = Pipeline(draft)
    lookahead = Lookahead()
    sampled = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    async with running(p.batcher):
        proposal, _, _ = await p.batcher.propose(DraftJob(JobSession("s", sampled, gen()), K))
        sent = proposal.token_ids
        race = (99, len(p.committed) + len(sent))
        with torch.inference_mode():
            logits = draft.model(input_ids=torch.tensor([PROMPT + sent])).logits[0, -1]
        guess = guess_token(logits, sampled, race)
        after = Continuation(tuple(sent), len(p.committed), guess=race)
        lookahead.start(p.batcher, DraftJob(JobSession("s", sampled, gen()), K + 1, after=after))
        own = guess if came_true else (guess + 1) % draft.vocab_size
        tokens = [*sent, own]
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        ready = lookahead.take(K)
    if not came_true:
        assert ready is None and outcomes(p.metrics)["missed"] == 1.0
        return
    assert ready is not None and ready.q is not None and len(ready.token_ids) == len(ready.q) == K
    for token, q in zip(ready.token_ids, ready.q, strict=True):
        check(q, token, draft.vocab_size)  # each kept token lists itself in the q it came from



@pytest.mark.asyncio
async def test_take_gives_at_most_the_new_budget(draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        expected = reference_greedy(draft, PROMPT + sent, K + 1)
        p.look_ahead(lookahead, sent)
        await lookahead.settle(verdict([*sent, expected[0]], len(sent)), len(sent), p.metrics)
        ready = lookahead.take(2)
    assert ready is not None and ready.token_ids == expected[1:3]


@pytest.mark.asyncio
async def test_a_ready_lookahead_is_screened_as_the_controller_would_screen_a_fresh_round(
        draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        expected = reference_greedy(draft, PROMPT + sent, K + 1)
        after = Continuation(tuple(sent), len(p.committed))
        lookahead.start(p.batcher, DraftJob(JobSession("s", GREEDY, gen()), K + 1, after=after, features=True))
        tokens = [*sent, expected[0]]
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        threshold = ThresholdController(0.0)
        ready = lookahead._ready
        assert ready is not None and len(ready.steps) == K
        # a threshold just above the second token's confidence stops after it
        threshold.threshold = ready.steps[1].top1_prob + 1e-9
        threshold.begin_round(K)
        screened = lookahead.take(K, threshold)
        threshold.begin_round(K)
        fresh, _, _ = await p.batcher.propose(DraftJob(JobSession("s", GREEDY, gen()), K, controller=threshold))
    assert screened is not None and screened.token_ids == fresh.token_ids
    assert len(fresh.token_ids) <= 2 and [s.position for s in screened.steps] == list(range(len(fresh.token_ids)))


@pytest.mark.parametrize("extra", [0, 2])
@pytest.mark.asyncio
async def test_a_continuous_verifier_may_commit_several_tokens_after_the_draft(extra: int,
                                                                               draft: LoadedModel) -> None:
    """vLLM decodes on while drafts travel: a Verdict may commit the whole draft and then several
    tokens (or none) of its own. The lookahead is used when it guessed all of them."""
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        expected = reference_greedy(draft, PROMPT + sent, K + 1)
        p.look_ahead(lookahead, sent)
        tokens = [*sent, *expected[:extra]]
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        ready = lookahead.take(K + 1)
        assert ready is not None and ready.token_ids == expected[extra:]
        assert lookahead.asked == K + 1 - extra  # what the proposer was asked for that the ready draft holds
        assert await p.round(K + 1 - extra) == expected[extra:]


@pytest.mark.asyncio
async def test_a_lookahead_whose_guess_missed_is_not_used(draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        guess = reference_greedy(draft, PROMPT + sent, 1)[0]
        other = (guess + 1) % draft.vocab_size
        p.look_ahead(lookahead, sent)
        tokens = [*sent, other]  # every draft accepted, but the verifier chose another token
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        assert lookahead.take(K) is None
        assert outcomes(p.metrics) == {"used": 0.0, "missed": 1.0, "dropped": 0.0}
        # the lookahead's tokens in the draft cache are rolled back: the next round is as if it never ran
        assert await p.round(K) == reference_greedy(draft, PROMPT + tokens, K)


@pytest.mark.asyncio
async def test_a_lookahead_past_a_rejected_draft_is_dropped(draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        p.look_ahead(lookahead, sent)
        tokens = [*sent[:2], (sent[2] + 1) % draft.vocab_size]  # two accepted, the third rejected
        p.commit(tokens, 2)
        await lookahead.settle(verdict(tokens, 2), len(sent), p.metrics)
        assert lookahead.take(K) is None
        assert outcomes(p.metrics) == {"used": 0.0, "missed": 0.0, "dropped": 1.0}
        assert await p.round(K) == reference_greedy(draft, PROMPT + tokens, K)


@pytest.mark.asyncio
async def test_a_lookahead_is_dropped_when_the_session_finishes(draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        guess = reference_greedy(draft, PROMPT + sent, 1)[0]
        p.look_ahead(lookahead, sent)
        await lookahead.settle(verdict([*sent, guess], len(sent), finished=True), len(sent), p.metrics)
        assert lookahead.take(K) is None
    assert outcomes(p.metrics) == {"used": 0.0, "missed": 0.0, "dropped": 1.0}


@pytest.mark.asyncio
async def test_a_cancelled_lookahead_settles_to_nothing_and_the_batcher_goes_on(draft: LoadedModel) -> None:
    p = Pipeline(draft)
    lookahead = Lookahead()
    async with running(p.batcher):
        sent = await p.round()
        guess = reference_greedy(draft, PROMPT + sent, 1)[0]
        p.look_ahead(lookahead, sent)
        lookahead.cancel()
        await lookahead.settle(verdict([*sent, guess], len(sent)), len(sent), p.metrics)
        assert lookahead.take(K) is None
        assert outcomes(p.metrics) == {"used": 0.0, "missed": 0.0, "dropped": 0.0}
        tokens = [*sent, guess]
        p.commit(tokens, len(sent))
        assert await p.round(K) == reference_greedy(draft, PROMPT + tokens, K)


@pytest.mark.asyncio
async def test_lookaheads_chain_over_rounds(draft: LoadedModel) -> None:
    """Three rounds in which the verifier agrees with the draft model: after the first, every
    round's draft comes from the previous round's lookahead, and the text is argmax decoding."""
    p = Pipeline(draft)
    lookahead = Lookahead()
    truth = reference_greedy(draft, PROMPT, 3 * (K + 1))
    async with running(p.batcher):
        sent = await p.round()
        for _ in range(3):
            p.look_ahead(lookahead, sent)
            tokens = truth[len(p.committed) - len(PROMPT):][: len(sent) + 1]
            assert tokens[:-1] == sent
            p.commit(tokens, len(sent))
            await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
            ready = lookahead.take(K)
            assert ready is not None
            sent = ready.token_ids
    assert p.committed == PROMPT + truth[: len(p.committed) - len(PROMPT)]
    assert outcomes(p.metrics)["used"] == 3.0


# --- batcher priority -----------------------------------------------------------------------------


class Recorder:
    """A proposer that records each batch (session ids) and can hold a batch until released."""

    name = "recorder"

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def start(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        pass

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        self.batches.append([j.session_id for j in jobs])
        self.entered.set()
        self.hold.wait(10)
        time.sleep(0.001)  # a measurable batch time
        return [Proposal(token_ids=[7] * j.k) for j in jobs]

    def commit(self, session_id: str, committed_new_tokens: list[int], accepted: int) -> None:
        pass

    def close(self, session_id: str) -> None:
        pass


def round_job(sid: str) -> DraftJob:
    return DraftJob(JobSession(sid, GREEDY, gen()), 2)


def lookahead_job(sid: str) -> DraftJob:
    return DraftJob(JobSession(sid, GREEDY, gen()), 1, after=Continuation((5, 6), len(PROMPT)))


async def queued(batcher: DraftBatcher, jobs: list[DraftJob]) -> list[asyncio.Task[tuple[Proposal, float, float]]]:
    tasks = [asyncio.create_task(batcher.propose(j)) for j in jobs]
    await asyncio.sleep(0)  # each task queues its job
    return tasks


def batch_ids(batch: Sequence[tuple[DraftJob, float, object]]) -> list[str]:
    return [job.session_id for job, _, _ in batch]


@pytest.mark.asyncio
async def test_next_batch_takes_rounds_first_and_lookaheads_only_when_no_round_is_ready() -> None:
    batcher = DraftBatcher(Recorder(), ComputeWorker(inline=True), DrafterMetrics(), max_batch=2)
    tasks = await queued(batcher, [lookahead_job("la1"), round_job("r1"), lookahead_job("la2"), round_job("r2"),
                                   round_job("r3")])
    tasks[1].cancel()  # a session that went away while its job waited
    await asyncio.sleep(0)
    assert batch_ids(batcher._next_batch()) == ["r2", "r3"]  # oldest first, at most max_batch
    assert batch_ids(batcher._next_batch()) == ["la1", "la2"]
    assert batcher._next_batch() == []
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.asyncio
async def test_a_round_that_becomes_ready_during_a_batch_goes_before_waiting_lookaheads() -> None:
    recorder, metrics = Recorder(), DrafterMetrics()
    worker = ComputeWorker()  # a real worker thread, so the event loop queues jobs while a batch drafts
    batcher = DraftBatcher(recorder, worker, metrics)
    try:
        async with running(batcher):
            recorder.hold.clear()
            first = await queued(batcher, [round_job("r0")])
            await asyncio.to_thread(recorder.entered.wait, 10)  # r0 is drafting
            later = await queued(batcher, [lookahead_job("la"), round_job("r1"), round_job("r2")])
            recorder.hold.set()
            results = await asyncio.wait_for(asyncio.gather(*first, *later), 10)
    finally:
        worker.shutdown()
    assert recorder.batches == [["r0"], ["r1", "r2"], ["la"]]
    get = metrics.registry.get_sample_value
    for kind, batches, sessions in [("round", 2, 3), ("lookahead", 1, 1)]:  # batch sizes by kind, apart
        assert get("specfleet_drafter_draft_batch_sessions_count", {"kind": kind}) == batches
        assert get("specfleet_drafter_draft_batch_sessions_sum", {"kind": kind}) == sessions
    assert [len(p.token_ids) for p, _, _ in results] == [2, 1, 2, 2]
    assert all(started <= ended for _, started, ended in results)


@pytest.mark.asyncio
async def test_lookahead_batches_do_not_feed_the_service_time_estimate() -> None:
    batcher = DraftBatcher(Recorder(), ComputeWorker(inline=True), DrafterMetrics())
    async with running(batcher):
        await batcher.propose(lookahead_job("la"))
        assert batcher.capacity.service_s == 0.0
        await batcher.propose(round_job("r"))
        assert batcher.capacity.service_s > 0.0


# --- capacity (StarSD §4.2) -----------------------------------------------------------------------


def warmed(service_s: float, return_s: float, tokens: int, rounds: int = WARM_ROUNDS) -> Capacity:
    cap = Capacity()
    for _ in range(rounds):
        cap.observe_batch(4 * service_s, 4)
        cap.observe_round(return_s, tokens)
    return cap


def test_capacity_says_nothing_until_warm() -> None:
    cap = warmed(0.01, 0.035, 3, rounds=WARM_ROUNDS - 1)
    assert not cap.warm and cap.n_full is None and cap.n_max is None
    cap.observe_round(0.035, 3)
    assert cap.warm and cap.n_full is not None
    rounds_only = Capacity()  # rounds seen, but never a drafting batch: S unknown
    for _ in range(WARM_ROUNDS):
        rounds_only.observe_round(0.035, 3)
    assert not rounds_only.warm and rounds_only.n_full is None and rounds_only.n_max is None


@pytest.mark.parametrize(("service_s", "return_s", "tokens", "n_full", "n_max"), [
    (0.01, 0.035, 3, 5, 10),  # Z/S = 3.5: N_full = 4 + 1; E Z / S = 10.5
    (0.01, 0.025, 1, 4, 4),  # E Z / S = 2.5 < N_full: N_max is N_full
    (0.02, 0.01, 2, 2, 2),  # the draft is slower than the return: two sessions fill it
    (0.002, 0.0507, 4, 27, 101),  # Z/S = 25.35
])
def test_n_full_and_n_max(service_s: float, return_s: float, tokens: int, n_full: int, n_max: int) -> None:
    cap = warmed(service_s, return_s, tokens)
    assert cap.service_s == pytest.approx(service_s) and cap.return_s == pytest.approx(return_s)
    assert cap.n_full == n_full == math.ceil(return_s / service_s) + 1
    assert cap.n_max == n_max == max(n_full, math.floor(tokens * return_s / service_s))


def test_capacity_estimates_are_moving_averages_per_session() -> None:
    cap = Capacity()
    cap.observe_batch(0.02, 2)  # the first observation is taken as it is: S = 0.02 / 2
    assert cap.service_s == pytest.approx(0.01)
    cap.observe_batch(0.03, 1)
    assert cap.service_s == pytest.approx((1 - ALPHA) * 0.01 + ALPHA * 0.03)
    cap.observe_batch(1.0, 0)  # an empty batch says nothing
    assert cap.service_s == pytest.approx((1 - ALPHA) * 0.01 + ALPHA * 0.03)
    cap.observe_round(0.05, 3)
    cap.observe_round(0.15, 1)
    assert cap.return_s == pytest.approx((1 - ALPHA) * 0.05 + ALPHA * 0.15)
    assert cap.tokens_per_round == pytest.approx((1 - ALPHA) * 3 + ALPHA * 1)
    assert cap.rounds == 2


@pytest.mark.parametrize(("admission", "warm", "limit"), [
    ("max-sessions", True, 8),  # the default never looks at N_max
    ("starsd", False, 8),  # no estimate yet: no limit but max_sessions
    ("starsd", True, 3),  # S 0.25, Z 0.5, E 1: N_max = max(N_full = 3, floor(1 * 0.5 / 0.25) = 2)
])
def test_session_limit_is_n_max_under_starsd_admission(admission: str, warm: bool, limit: int) -> None:
    cap = Capacity()
    cap.observe_batch(0.25, 1)
    for _ in range(WARM_ROUNDS if warm else 1):
        cap.observe_round(0.5, 1)
    assert make_admission(admission).limit(8, cap) == limit
