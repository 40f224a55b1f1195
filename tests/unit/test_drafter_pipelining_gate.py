"""Which sessions draft their next round while this one is verified (pipelined drafting):
greedy ones always, sampled ones only when unseeded and their verifier couples its bonus token
(shared.coupling), and only with a proposer that can guess it."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from services.drafter.batcher import DraftBatcher
from services.drafter.control import make_controller
from services.drafter.proposers.base import DraftJob, Proposal
from services.drafter.rounds import RoundSettings, SessionRunner
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.protocol import MAX_CONDITIONAL_DRAFTS, QueuedRequest, SamplingParams, Verdict
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
    runner = SessionRunner(None, proposer, worker, DraftBatcher(proposer, worker),  # type: ignore[arg-type]
                           RoundSettings(max_draft_tokens=4))
    assert runner._pipelines(session, Proposal(token_ids=[7, 8])) is ahead
    assert not runner._pipelines(session, Proposal(token_ids=[]))  # nothing sent, nothing to continue


class _Recorder:
    def __init__(self) -> None:
        self.jobs: list[DraftJob] = []
        self.alternatives: list[list[tuple[int, int]]] = []
        self.presends: list[object] = []
        self.screens: list[object] = []

    def start(self, batcher: object, job: DraftJob, alternatives: Sequence[tuple[int, int]] = (),
              presend: object = None, screen: object = None) -> None:
        self.jobs.append(job)
        self.alternatives.append(list(alternatives))
        self.presends.append(presend)
        self.screens.append(screen)


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
    runner = SessionRunner(None, proposer, worker, DraftBatcher(proposer, worker),  # type: ignore[arg-type]
                           RoundSettings(max_draft_tokens=4))
    runner._look_ahead(session, Proposal(token_ids=[7, 8]), 2, guess=False)
    (job,) = recorder.jobs
    assert job.controller is None and (job.features, job.spread) == (features, spread)
    assert recorder.screens == [controller]  # a conditional Draft is cut where the controller would stop it
    assert job.after.assume == (7, 8) and job.k == 3


@pytest.mark.parametrize(("temperature", "active", "branches", "expected"), [
    (0.0, 1, 1, [(1, 11)]),  # alone on the drafter: the likeliest rejection (position 1 hit before)
    (0.0, 1, 2, [(1, 11), (0, 10)]),
    (0.0, 2, 1, []),  # another session shares the draft model: no alternative
    (0.0, 1, 0, []),  # --lookahead-branches 0
    (1.0, 1, 1, []),  # sampled: its correction comes from p - q, not the runner-up
], ids=["alone", "two", "shared-drafter", "off", "sampled"])
def test_alternative_lookaheads_only_for_a_greedy_session_alone(temperature: float, active: int, branches: int,
                                                                expected: list[tuple[int, int]]) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=64)
    req = QueuedRequest(request_id="r", prompt_ids=[1, 2], params=params, origin="c", model="m", created_at=0.0)
    session = DraftSession.from_delivery(Delivery("1", req), make_controller("fixed"))
    session.bonus_key = 5
    recorder = _Recorder()
    session.lookahead = recorder  # type: ignore[assignment]
    proposer = _Guesser(True)
    worker = ComputeWorker(inline=True)
    settings = RoundSettings(max_draft_tokens=4, lookahead_branches=branches)
    runner = SessionRunner(None, proposer, worker, DraftBatcher(proposer, worker), settings,  # type: ignore[arg-type]
                           active=lambda: active)
    sent = Proposal(token_ids=[7, 8, 9], runner_up=[10, 11, 12])
    runner.odds.observe(sent, Verdict(request_id="r", round=0, accepted=1, token_ids=[7, 11], finished=False,
                                      finish_reason=None, draft_budget=4), 3)  # rejected at 1, for the runner-up
    runner._look_ahead(session, sent, 3, guess=temperature > 0)
    assert recorder.alternatives == [expected]


@pytest.mark.parametrize(("branches", "conditional", "presends"), [
    (1, True, True),
    (MAX_CONDITIONAL_DRAFTS - 1, True, True),  # every branch fits in what the verifier holds
    (MAX_CONDITIONAL_DRAFTS, True, False),  # one too many: they all wait for their verdict
    (1, False, False),  # the verifier does not take conditional drafts
])
def test_lookaheads_go_out_early_only_when_the_verifier_holds_them_all(branches: int, conditional: bool,
                                                                       presends: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    req = QueuedRequest(request_id="r", prompt_ids=[1, 2], params=params, origin="c", model="m", created_at=0.0)
    session = DraftSession.from_delivery(Delivery("1", req), make_controller("fixed"))
    recorder = _Recorder()
    session.lookahead = recorder  # type: ignore[assignment]
    proposer = _Guesser(True)
    worker = ComputeWorker(inline=True)
    settings = RoundSettings(max_draft_tokens=16, lookahead_branches=branches, conditional=conditional)
    runner = SessionRunner(None, proposer, worker, DraftBatcher(proposer, worker), settings)  # type: ignore[arg-type]
    sent = Proposal(token_ids=list(range(20, 36)), runner_up=list(range(40, 56)))
    runner._look_ahead(session, sent, 16, guess=False)
    assert len(recorder.alternatives[0]) == branches and (recorder.presends[0] is not None) is presends
