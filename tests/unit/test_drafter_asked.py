"""A drafter counts the draft tokens each round asked its proposer for beside those it sent: a
model-free proposer sends fewer when its match runs out; and apart, those of rounds it drafted then,
not from a lookahead (what the simulator's validation reads)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from services.drafter.batcher import DraftBatcher
from services.drafter.control import ControlSettings, make_controller
from services.drafter.proposers.base import DraftJob, Proposal
from services.drafter.proposers.ngram import NgramProposer
from services.drafter.rounds import RoundSettings, SessionRunner
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.protocol import Draft, QueuedRequest, SamplingParams, Verdict
from shared.queue import Delivery

PROMPT = [5, 6, 7, 8, 5, 6]  # "5 6" was seen before: lookup proposes 7 8 5 6 …


class ScriptedVerifier:
    """The verifier link's send side: records each Draft and answers it with the next verdict (and,
    as the verifier runs a round of budget 0 without a draft, the one after a verdict giving 0)."""

    def __init__(self, verdicts: list[Verdict]) -> None:
        self.inbox: asyncio.Queue[object] = asyncio.Queue()
        self.verdicts = verdicts
        self.sent: list[Draft] = []

    async def send(self, msg: object) -> None:
        assert isinstance(msg, Draft)
        self.sent.append(msg)
        answer = self.verdicts.pop(0)
        await self.inbox.put(answer)
        while answer.draft_budget == 0 and not answer.finished and self.verdicts:
            answer = self.verdicts.pop(0)
            await self.inbox.put(answer)


def verdict(rnd: int, accepted: int, tokens: list[int], budget: int, finished: bool = False) -> Verdict:
    return Verdict(request_id="r", round=rnd, accepted=accepted, token_ids=tokens, finished=finished,
                   finish_reason="stop" if finished else None, draft_budget=budget)


class BrokenNgram(NgramProposer):
    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        raise RuntimeError("the proposer broke")


async def play(verdicts: list[Verdict], pipeline_sessions: int = 0,
               proposer: NgramProposer | None = None) -> tuple[list[list[int]], SessionRunner]:
    """One greedy n-gram session with a first budget of 3, through a round per verdict: the drafts
    sent, and the runner (its metrics)."""
    req = QueuedRequest(request_id="r", prompt_ids=PROMPT, params=SamplingParams(temperature=0.0, max_tokens=64),
                        origin="c", model="m", created_at=time.time())
    session = DraftSession.from_delivery(Delivery("1", req), make_controller("fixed", ControlSettings()))
    session.budget = 3
    proposer = proposer or NgramProposer(eos_ids={0})
    proposer.start("r", PROMPT, req.params.max_tokens)
    worker, link = ComputeWorker(inline=True), ScriptedVerifier(verdicts)
    batcher = DraftBatcher(proposer, worker)
    runner = SessionRunner(link, proposer, worker, batcher,  # type: ignore[arg-type]
                           RoundSettings(max_draft_tokens=8, pipeline_sessions=pipeline_sessions))
    drafting = asyncio.create_task(batcher.run())
    for _ in range(len(verdicts)):
        await runner._round(session, link.inbox)  # type: ignore[arg-type]
    drafting.cancel()
    await asyncio.wait([drafting])
    return [d.token_ids for d in link.sent], runner


@pytest.mark.asyncio
async def test_rounds_count_the_tokens_asked_for_and_those_the_ngram_found() -> None:
    # round 0: three asked, three found (7 8 5), all accepted, then 9: nothing ever followed "… 5 6 7 8 5 9"
    sent, runner = await play([verdict(0, 3, [7, 8, 5, 9], 3), verdict(1, 0, [4], 3)])
    assert sent == [[7, 8, 5], []]
    get = runner.metrics.registry.get_sample_value
    assert get("specfleet_drafter_asked_tokens_total") == 6.0
    assert get("specfleet_drafter_drafted_tokens_total") == get("specfleet_drafter_round_drafted_tokens_total") == 3.0
    assert get("specfleet_drafter_rounds_total") == 2.0
    assert get("specfleet_drafter_committed_tokens_total") == 5.0


@pytest.mark.asyncio
async def test_a_round_the_verifier_runs_target_only_counts_its_tokens_though_no_draft_went() -> None:
    """Budget 0 (GoodSpeed gave this drafter none): the verifier decodes the round alone, and its
    token still counts for the drafter's sessions (a per-drafter goodput without it understates
    the drafters the budget left out)."""
    sent, runner = await play([verdict(0, 3, [7, 8, 5, 9], 0), verdict(1, 0, [4], 3)])
    assert sent == [[7, 8, 5]]
    get = runner.metrics.registry.get_sample_value
    assert get("specfleet_drafter_rounds_total") == 1.0  # the drafted round alone
    assert get("specfleet_drafter_committed_tokens_total") == 5.0


@pytest.mark.asyncio
async def test_a_round_drafted_ahead_asked_for_what_its_lookahead_was_asked_for() -> None:
    """A lookahead drafts as many tokens as the round before it asked for; the next round taking it
    under a larger budget asked its proposer for no more than that (the simulator caps it alike)."""
    # round 0 sends 7 8 5 and drafts ahead 6 7 8 5 (its guess of the verifier's token, then 3 more);
    # the verdict makes it true and raises the budget to 5
    sent, runner = await play([verdict(0, 3, [7, 8, 5, 6], 5), verdict(1, 3, [7, 8, 5, 6], 0, finished=True)],
                              pipeline_sessions=2)
    assert sent == [[7, 8, 5], [7, 8, 5]]
    get = runner.metrics.registry.get_sample_value
    assert get("specfleet_drafter_lookaheads_total", {"outcome": "used"}) == 1.0
    assert get("specfleet_drafter_asked_tokens_total") == get("specfleet_drafter_drafted_tokens_total") == 6.0
    # the draft model's round time drafted only the first round's: the second's came from the lookahead
    assert get("specfleet_drafter_round_drafted_tokens_total") == 3.0


@pytest.mark.asyncio
async def test_a_session_whose_proposer_broke_asks_for_nothing() -> None:
    """Drafting fails once and the session goes on target-only with empty drafts: those rounds asked
    the proposer for nothing (else they would read as a proposer that never finds a draft)."""
    sent, runner = await play([verdict(0, 0, [7], 3), verdict(1, 0, [8], 3)], proposer=BrokenNgram(eos_ids={0}))
    assert sent == [[], []]
    get = runner.metrics.registry.get_sample_value
    assert get("specfleet_drafter_asked_tokens_total") == get("specfleet_drafter_drafted_tokens_total") == 0.0
    assert get("specfleet_drafter_rounds_total") == 2.0
