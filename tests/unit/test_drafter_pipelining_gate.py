"""Which sessions draft their next round while this one is verified (pipelined drafting):
greedy ones always, sampled ones only when unseeded and their verifier couples its bonus token
(shared.coupling), and only with a proposer that can guess it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.drafter.batcher import DraftBatcher
from services.drafter.control import make_controller
from services.drafter.proposers.base import DraftJob, Proposal
from services.drafter.rounds import SessionRunner
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.protocol import QueuedRequest, SamplingParams
from shared.queue import Delivery


class _Guesser:
    def __init__(self, guesses: bool) -> None:
        self.guesses_bonus = guesses


@pytest.mark.parametrize(("temperature", "seed", "key", "guesses", "ahead"), [
    (0.0, None, None, False, True),  # greedy: drafts draw no randomness
    (1.0, None, 5, True, True),  # unseeded sampled, a verifier that couples its token, a draft model
    (1.0, 3, 5, True, False),  # seeded: its stream must not depend on whether a lookahead ran
    (1.0, None, None, True, False),  # the verifier does not couple its token (the vLLM core)
    (1.0, None, 5, False, False),  # the proposer cannot guess it (n-gram)
], ids=["greedy", "sampled", "seeded", "uncoupled-verifier", "ngram"])
def test_which_sessions_draft_ahead(temperature: float, seed: int | None, key: int | None, guesses: bool,
                                    ahead: bool) -> None:
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=64)
    req = QueuedRequest(request_id="r", prompt_ids=[1, 2], params=params, origin="c", model="m", created_at=0.0)
    session = DraftSession.from_delivery(Delivery("1", req), make_controller("fixed"))
    session.bonus_key = key
    proposer = _Guesser(guesses)
    worker = ComputeWorker(inline=True)
    runner = SessionRunner(None, proposer, worker, DraftBatcher(proposer, worker), max_draft_tokens=4)  # type: ignore[arg-type]
    assert runner._pipelines(session, Proposal(token_ids=[7, 8])) is ahead
    assert not runner._pipelines(session, Proposal(token_ids=[]))  # nothing sent, nothing to continue


class _Recorder:
    def __init__(self) -> None:
        self.jobs: list[DraftJob] = []

    def start(self, batcher: object, job: DraftJob, alternatives: object = ()) -> None:
        self.jobs.append(job)


@pytest.mark.parametrize(("features", "spread"), [(False, False), (True, False), (True, True)],
                         ids=["fixed", "threshold-like", "wisp-like"])
def test_a_lookahead_computes_the_features_its_controller_will_screen_it_with(features: bool, spread: bool) -> None:
    """The lookahead is drafted without a controller (it is not a round), and screened by the
    session's controller when the next round takes it: it must compute what that controller reads,
    entropy and logit spread included for one that reads them (WISP), or WISP screens NaNs."""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    req = QueuedRequest(request_id="r", prompt_ids=[1, 2], params=params, origin="c", model="m", created_at=0.0)
    controller = SimpleNamespace(name="stub", wants_features=features, wants_spread=spread)
    session = DraftSession.from_delivery(Delivery("1", req), controller)  # type: ignore[arg-type]
    recorder = _Recorder()
    session.lookahead = recorder  # type: ignore[assignment]
    proposer = _Guesser(False)
    worker = ComputeWorker(inline=True)
    runner = SessionRunner(None, proposer, worker, DraftBatcher(proposer, worker), max_draft_tokens=4)  # type: ignore[arg-type]
    runner._look_ahead(session, Proposal(token_ids=[7, 8]), 2, guess=False)
    (job,) = recorder.jobs
    assert job.controller is None and (job.features, job.spread) == (features, spread)
    assert job.assume == (7, 8) and job.k == 3
