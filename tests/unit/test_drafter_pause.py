"""A drafter whose controller declines to draft asks the verifier not to wait for it
(``Draft.pause_rounds``), serves the paused rounds without drafting, and drafts again after."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from services.drafter.batcher import DraftBatcher
from services.drafter.control import ControlSettings, make_controller
from services.drafter.control.throughput import RoundClock, ThroughputState
from services.drafter.proposers.draft_model import DraftModelProposer
from services.drafter.rounds import PAUSE_ROUNDS, RoundSettings, SessionRunner
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.models import load_model
from shared.protocol import Draft, QueuedRequest, SamplingParams, Verdict
from shared.queue import Delivery
from shared.runner import ModelRunner


class RecordingLink:
    """The verifier link's send side: records what the drafter sends."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, msg: object) -> None:
        self.sent.append(msg)


def declining_controller() -> object:
    """AdaSpec with a measured clock and a history of unsure drafts that were all rejected."""
    clock = RoundClock()
    for _ in range(200):
        for j in (1, 3, 5):
            clock.observe(j, j * 0.002, 0.005 + 0.001 * j)
    state = ThroughputState(clock=clock)
    for _ in range(50):
        state.calibration.observe([0.15] * 6, accepted=0)
    return make_controller("adaspec", ControlSettings(adaspec=state))


def verdict(rnd: int, token: int, budget: int) -> Verdict:
    return Verdict(request_id="r", round=rnd, accepted=0, token_ids=[token], finished=False,
                   finish_reason=None, draft_budget=budget)


def one_session(tiny_models: dict[str, Path], controller: object,
             settings: RoundSettings) -> tuple[DraftSession, RecordingLink, SessionRunner, DraftBatcher]:
    """One greedy session of request "r" (prompt 1, 2, 3) on the tiny draft, its rounds run inline."""
    req = QueuedRequest(request_id="r", prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=64),
                        origin="c", model="m", created_at=time.time())
    session = DraftSession.from_delivery(Delivery("1", req), controller)  # type: ignore[arg-type]
    draft = load_model(tiny_models["draft-L1"])
    proposer = DraftModelProposer(ModelRunner(draft, 4 * draft.max_model_len * 1024, self_check=False), draft.eos_ids)
    proposer.start("r", list(req.prompt_ids), req.params.max_tokens)
    worker = ComputeWorker(inline=True)
    batcher = DraftBatcher(proposer, worker)
    link = RecordingLink()
    return session, link, SessionRunner(link, proposer, worker, batcher, settings), batcher  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_declined_round_asks_for_a_pause_and_the_paused_rounds_send_nothing(
        tiny_models: dict[str, Path]) -> None:
    session, link, runner, _ = one_session(tiny_models, declining_controller(), RoundSettings(max_draft_tokens=8))
    session.budget = 4
    inbox: asyncio.Queue[object] = asyncio.Queue()
    await inbox.put(verdict(0, 50, budget=0))  # the verifier grants the pause: budget 0 for the next rounds
    await runner._round(session, inbox)  # type: ignore[arg-type]
    assert link.sent == [Draft(request_id="r", round=0, token_ids=[], pause_rounds=PAUSE_ROUNDS)]
    for rnd in range(1, 4):  # paused rounds: nothing is sent, each verdict is taken as it comes
        await inbox.put(verdict(rnd, 50 + rnd, budget=0 if rnd < 3 else 4))
        await runner._round(session, inbox)  # type: ignore[arg-type]
    assert len(link.sent) == 1
    assert session.committed == [1, 2, 3, 50, 51, 52, 53] and session.budget == 4


@pytest.mark.asyncio
async def test_a_fresh_draft_carries_the_drafters_time_drafting_it(tiny_models: dict[str, Path]) -> None:
    """``Draft.drafting_s``: the draft model's time for this draft, which SmartSpec prices the wait
    for a length by (``draft_wait.Timed``); not drafted ahead."""
    session, link, runner, batcher = one_session(tiny_models, make_controller("fixed"),
                                                 RoundSettings(max_draft_tokens=8, pipeline_sessions=0))  # no lookahead
    session.budget = 3
    inbox: asyncio.Queue[object] = asyncio.Queue()
    await inbox.put(verdict(0, 50, budget=3))
    drafting = asyncio.create_task(batcher.run())
    try:
        began = time.perf_counter()
        await runner._round(session, inbox)  # type: ignore[arg-type]
        took = time.perf_counter() - began
    finally:
        drafting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drafting
    sent = link.sent[0]
    assert isinstance(sent, Draft) and len(sent.token_ids) == 3 and not sent.ahead
    assert 0 < sent.drafting_s <= took
