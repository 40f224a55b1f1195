"""The model-free n-gram proposer and the confidence-threshold controller."""

from __future__ import annotations

import pytest

from services.drafter.control import ControlSettings, make_controller
from services.drafter.control.base import Spread, StepDecision, StepFeatures
from services.drafter.proposers.base import Continuation, DraftJob, JobSession, ProposerError
from services.drafter.proposers.ngram import NgramProposer, lookup
from shared.protocol import SamplingParams
from shared.sampling import make_generator

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.mark.parametrize(
    ("context", "k", "max_n", "min_n", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 3, 4, 1, [3, 4, 1]),  # "1 2" seen before: what followed it
        ([5, 6, 7, 5, 6, 7, 5], 4, 4, 1, [6, 7, 5]),  # the longest match wins, and it may overlap the tail
        ([1, 2, 3], 2, 4, 1, []),  # nothing repeats
        ([9, 1, 9, 2, 9], 2, 4, 1, [2, 9]),  # the most recent occurrence of "9"
        ([9, 1, 9, 2, 9], 2, 4, 2, []),  # no bigram repeats
        ([256, 1, 256], 2, 4, 1, [1, 256]),  # ids above a byte: matched as whole tokens
        ([1, 256, 1, 0, 1], 5, 1, 1, [0, 1]),  # never a match that straddles two tokens' bytes
        ([7, 7], 3, 4, 1, [7]),
        ([4], 3, 4, 1, []),
        ([1, 2, 1, 2], 0, 4, 1, []),
    ],
)
def test_lookup(context: list[int], k: int, max_n: int, min_n: int, expected: list[int]) -> None:
    assert lookup(context, k, max_n, min_n) == expected


def _job(sid: str, k: int, params: SamplingParams = GREEDY, assume: tuple[int, ...] = (), base: int = -1) -> DraftJob:
    return DraftJob(JobSession(sid, params, make_generator(0, "draft")), k, after=Continuation(assume, base))


def test_ngram_proposer_follows_commits_and_stops_after_an_end_token() -> None:
    proposer = NgramProposer(eos_ids={0}, max_n=3)
    proposer.start("s", [3, 4, 5, 0, 3, 4], 32)
    proposer.start("t", [8, 9], 32)
    s, t, ghost = proposer.propose([_job("s", 4), _job("t", 4), _job("ghost", 4)])
    assert s.token_ids == [5, 0] and s.final and s.q is None  # the end token is kept, nothing after it
    assert t.token_ids == [] and ghost.token_ids == []
    no_eos = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert proposer.propose([_job("s", 4, no_eos)])[0].token_ids == [5, 0, 3, 4]
    proposer.commit("t", [8, 9], 0)
    assert proposer.propose([_job("t", 2)])[0].token_ids == [8, 9]
    # a lookahead drafts after the draft in flight, as if accepted
    assert proposer.propose([_job("t", 1, assume=(8,), base=4)])[0].token_ids == [9]
    proposer.close("t")
    with pytest.raises(ProposerError):
        proposer.commit("t", [1], 0)


def test_ngram_sizes_validated() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(set(), max_n=1, min_n=2)


def _step(top1: float) -> StepFeatures:
    return StepFeatures(position=0, budget=4, token_id=1, token_prob=top1, top1_prob=top1, top2_prob=0.0,
                        spread=Spread(entropy=0.5))


@pytest.mark.parametrize(("threshold", "top1", "decision"), [(0.4, 0.39, StepDecision.STOP),
                                                              (0.4, 0.4, StepDecision.CONTINUE),
                                                              (0.0, 0.01, StepDecision.CONTINUE),
                                                              (1.0, 0.99, StepDecision.STOP)])
def test_threshold_controller(threshold: float, top1: float, decision: StepDecision) -> None:
    controller = make_controller("threshold", ControlSettings(threshold=threshold))
    assert controller.wants_features and controller.begin_round(5) == 5
    assert controller.on_step(_step(top1)) is decision


def test_threshold_out_of_range_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        make_controller("threshold", ControlSettings(threshold=1.5))
