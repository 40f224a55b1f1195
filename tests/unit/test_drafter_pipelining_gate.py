"""Which sessions draft their next round while this one is verified (pipelined drafting):
greedy ones always, sampled ones only when unseeded and their verifier couples its bonus token
(shared.coupling), and only with a proposer that can guess it."""

from __future__ import annotations

import pytest

from services.drafter.batcher import DraftBatcher
from services.drafter.control import make_controller
from services.drafter.proposers.base import Proposal
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
