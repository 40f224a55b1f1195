"""Conditional drafts on the drafter's side: a lookahead goes to the verifier as soon as it is
drafted, and the verdict tells whether the verifier holds it as the next round's draft."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.drafter.control.base import DraftController, StepDecision
from services.drafter.lookahead import Lookahead
from services.drafter.proposers.base import Continuation, DraftJob, JobSession, Proposal
from shared.models import LoadedModel, load_model
from shared.protocol import Verdict
from tests.unit.draft_proposer_support import PROMPT, K, StopAt, gen, verdict
from tests.unit.test_drafter_pipeline import GREEDY, Pipeline, reference_greedy, running

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def draft(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["draft-L1"])


class Sent:
    """Records the conditional drafts a lookahead sends: (after, tokens)."""

    def __init__(self) -> None:
        self.drafts: list[tuple[tuple[int, ...], list[int]]] = []

    async def __call__(self, after: tuple[int, ...], draft: Proposal) -> bool:
        self.drafts.append((after, list(draft.token_ids)))
        return False


async def sent_once(sent: Sent, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not sent.drafts:
            await asyncio.sleep(0.001)


def start(p: Pipeline, lookahead: Lookahead, sent: list[int], presend: Sent,
          alternatives: list[tuple[int, int]] | None = None, screen: DraftController | None = None) -> None:
    job = DraftJob(JobSession("s", GREEDY, gen(0)), K + 1, after=Continuation(tuple(sent), len(p.committed)),
                   features=screen is not None)
    lookahead.start(p.batcher, job, alternatives or [], presend, screen)


async def drafted_ahead(p: Pipeline, lookahead: Lookahead, presend: Sent, draft: LoadedModel,
                        screen: DraftController | None = None) -> tuple[list[int], list[int]]:
    """Round 0's draft, and the all-accepted lookahead after it, once that was sent: (sent, the
    draft model's greedy continuation after sent)."""
    sent = await p.round()
    start(p, lookahead, sent, presend, screen=screen)
    await sent_once(presend)
    return sent, reference_greedy(draft, PROMPT + sent, K + 1)


@pytest.mark.asyncio
async def test_a_lookahead_is_sent_before_the_verdict_and_the_verdict_says_it_is_held(draft: LoadedModel) -> None:
    p, lookahead, presend = Pipeline(draft), Lookahead(), Sent()
    async with running(p.batcher):
        sent, expected = await drafted_ahead(p, lookahead, presend, draft)
        # sent as: the next round's draft if this round commits the drafts and the guessed token
        assert presend.drafts == [((*sent, expected[0]), expected[1:])]
        tokens = [*sent, expected[0]]
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        assert lookahead.presented  # the verifier holds it: the next round sends nothing
        ready = lookahead.take(K)
        assert ready is not None and ready.token_ids == expected[1:] and not lookahead.presented
        assert p.metrics.registry.get_sample_value("specfleet_drafter_presented_lookaheads_total") == 1.0


@pytest.mark.parametrize("outcome", ["rejected", "no budget", "another guess"])
@pytest.mark.asyncio
async def test_a_verdict_other_than_the_assumed_one_leaves_nothing_held(draft: LoadedModel, outcome: str) -> None:
    p, lookahead, presend = Pipeline(draft), Lookahead(), Sent()
    async with running(p.batcher):
        sent, expected = await drafted_ahead(p, lookahead, presend, draft)
        if outcome == "rejected":
            reply = verdict([*sent[:1], (sent[1] + 1) % draft.vocab_size], 1)
        elif outcome == "another guess":
            reply = verdict([*sent, (expected[0] + 1) % draft.vocab_size], len(sent))
        else:
            reply = Verdict(request_id="s", round=0, accepted=len(sent), token_ids=[*sent, expected[0]],
                            finished=False, finish_reason=None, draft_budget=0)
        p.commit(list(reply.token_ids), reply.accepted)
        await lookahead.settle(reply, len(sent), p.metrics)
        assert not lookahead.presented


@pytest.mark.asyncio
async def test_a_lookahead_finished_after_its_verdict_came_is_not_sent(draft: LoadedModel) -> None:
    """Once the verdict is being settled the verifier has moved on: the drafter drafts afresh (or
    takes the lookahead itself), and never sends the round a second draft."""
    p, lookahead, presend = Pipeline(draft), Lookahead(), Sent()
    async with running(p.batcher):
        sent = await p.round()
        expected = reference_greedy(draft, PROMPT + sent, K + 1)
        start(p, lookahead, sent, presend)
        tokens = [*sent, expected[0]]
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)  # before the lookahead ran
        assert presend.drafts == [] and not lookahead.presented
        ready = lookahead.take(K)
        assert ready is not None and ready.token_ids == expected[1:]  # used the old way


@pytest.mark.asyncio
async def test_an_alternative_branch_is_sent_with_the_outcome_it_assumes(draft: LoadedModel) -> None:
    p, lookahead, presend = Pipeline(draft), Lookahead(), Sent()
    async with running(p.batcher):
        sent = await p.round()
        other = (sent[1] + 1) % draft.vocab_size
        start(p, lookahead, sent, presend, alternatives=[(1, other)])
        async with asyncio.timeout(10):
            while len(presend.drafts) < 2:
                await asyncio.sleep(0.001)
        alt = reference_greedy(draft, [*PROMPT, sent[0], other], K)
        assert ((sent[0], other), alt) in presend.drafts  # draft 1 rejected, ``other`` committed instead
        tokens = [sent[0], other]
        p.commit(tokens, 1)
        await lookahead.settle(verdict(tokens, 1), len(sent), p.metrics)
        assert lookahead.presented
        ready = lookahead.take(K)
        assert ready is not None and ready.token_ids == alt


@pytest.mark.asyncio
async def test_a_conditional_draft_is_cut_where_the_controller_would_stop_and_shown_to_it(draft: LoadedModel) -> None:
    """The round in flight owns the controller: the cut is its pure screen (``keeps``), which sees
    nothing; the round that takes the presented draft shows it the tokens the verifier holds."""
    p, lookahead, presend, controller = Pipeline(draft), Lookahead(), Sent(), StopAt(1, StepDecision.STOP)
    async with running(p.batcher):
        sent, expected = await drafted_ahead(p, lookahead, presend, draft, screen=controller)
        assert presend.drafts == [((*sent, expected[0]), expected[1:3])] and controller.seen == []
        tokens = [*sent, expected[0]]
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        assert lookahead.presented
        ready = lookahead.take(K, controller)
        assert ready is not None and ready.token_ids == expected[1:3]  # what the verifier holds
        assert [(s.position, s.token_id) for s in controller.seen] == [(0, expected[1]), (1, expected[2])]


@pytest.mark.asyncio
async def test_a_draft_the_controller_would_not_keep_is_not_sent(draft: LoadedModel) -> None:
    p, lookahead, presend, controller = Pipeline(draft), Lookahead(), Sent(), StopAt(0, StepDecision.DISCARD)
    async with running(p.batcher):
        sent = await p.round()
        start(p, lookahead, sent, presend, screen=controller)
        tokens = [*sent, reference_greedy(draft, PROMPT + sent, 1)[0]]
        async with asyncio.timeout(10):
            await lookahead._branches[0].task  # drafted before the verdict: sent, were it kept
        p.commit(tokens, len(sent))
        await lookahead.settle(verdict(tokens, len(sent)), len(sent), p.metrics)
        assert presend.drafts == [] and not lookahead.presented
