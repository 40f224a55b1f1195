"""The draft-model proposer's step features (computed for all rows of a forward at once) and the
controllers that read them to stop drafting."""

from __future__ import annotations

import math

import pytest
import torch

from services.drafter.control import make_controller
from services.drafter.control.base import Spread, StepDecision, StepFeatures
from services.drafter.control.fixed import FixedController
from services.drafter.proposers.base import DraftJob, JobSession
from shared.models import LoadedModel
from shared.penalties import apply_penalties
from shared.protocol import SamplingParams
from tests.unit.draft_proposer_support import (
    GREEDY,
    PROMPT,
    WARM,
    StopAt,
    gen,
    make,
    propose,
    reference_greedy,
    reference_logits,
    tiny_draft,
)

torch.set_num_threads(1)

RUNNER_RTOL = 1e-2  # the cached runner's logits against a plain transformers forward: within 0.6 % here


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_draft(tmp_path_factory)


# --- controllers ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("decision", "expected_len"), [(StepDecision.STOP, 3), (StepDecision.DISCARD, 2)])
def test_controller_can_stop_drafting(draft: LoadedModel, decision: StepDecision, expected_len: int) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    controller = StopAt(2, decision)
    proposal = propose(proposer, "s", 6, GREEDY, gen(0), controller)
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 6)[:expected_len]
    assert [s.position for s in controller.seen] == [0, 1, 2]


def test_step_features_describe_the_draft_distribution(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 4, GREEDY, gen(0), StopAt(99, StepDecision.CONTINUE))
    assert len(proposal.steps) == 4
    for pos, (token, step) in enumerate(zip(proposal.token_ids, proposal.steps, strict=True)):
        assert (step.position, step.budget, step.token_id) == (pos, 4, token)
        assert step.token_prob == pytest.approx(step.top1_prob)  # greedy drafts the top-1 token
        assert 0.0 <= step.top2_prob <= step.top1_prob <= 1.0
        assert step.margin >= 0.0
        assert 0.0 <= step.spread.entropy <= float(torch.log(torch.tensor(draft.vocab_size)))


class _Watch(StopAt):
    """Never stops; reads the spread or not."""

    def __init__(self, spread: bool) -> None:
        super().__init__(99, StepDecision.CONTINUE)
        self.wants_spread = spread


def _reference_features(logits: torch.Tensor, token: int) -> tuple[float, float, float, float, float]:
    probs = logits.float().softmax(-1)
    top = probs.topk(2).values.tolist()
    return (float(probs[token]), top[0], top[1], float(torch.special.entr(probs).sum()), float(logits.float().std()))


@pytest.mark.parametrize("with_penalised", [True, False], ids=["a row penalised", "the step's top two"])
def test_step_features_of_a_batch_are_each_rows_own(draft: LoadedModel, with_penalised: bool) -> None:
    """Features come from one batched computation over the rows that want them; each row's equal
    a plain softmax of that session's own (penalised, where it has penalties) logits, and a
    controller that does not read the spread gets NaN there. Without a penalised row they reuse
    the step's top two logits, picking the rows that want them out of the step's."""
    proposer = make(draft)
    prompts = {"plain": PROMPT, "penalised": PROMPT[::-1], "spread": [3, *PROMPT], "none": PROMPT[2:],
               "ahead": PROMPT[1:]}
    if not with_penalised:
        del prompts["penalised"]
    penalised = SamplingParams(temperature=0.0, max_tokens=64, frequency_penalty=1.5, logit_bias={7: -100.0})
    params = {"plain": GREEDY, "penalised": penalised, "spread": WARM, "none": GREEDY, "ahead": GREEDY}
    watches = {"plain": _Watch(False), "penalised": _Watch(True), "spread": _Watch(True), "none": None, "ahead": None}
    for sid, prompt in prompts.items():
        proposer.start(sid, prompt, 64)
    # "ahead" is drafted as a lookahead is: no controller, features (with the spread) for a later screening
    jobs = [DraftJob(JobSession(sid, params[sid], gen(i), prompt_len=len(prompts[sid])), 3, controller=watches[sid],
                     features=sid == "ahead", spread=sid == "ahead") for i, sid in enumerate(prompts)]
    out = dict(zip(prompts, proposer.propose(jobs), strict=True))
    assert out["none"].steps == [] and len(out["none"].token_ids) == 3
    for sid in [sid for sid in prompts if sid != "none"]:
        steps, tokens = out[sid].steps, out[sid].token_ids
        assert len(steps) == len(tokens) == 3
        for pos, (token, step) in enumerate(zip(tokens, steps, strict=True)):
            ctx = [*prompts[sid], *tokens[:pos]]
            logits = reference_logits(draft, ctx)
            if sid == "penalised":
                logits = apply_penalties(logits[None], penalised, prompts[sid], tokens[:pos])[0]
            prob, top1, top2, entropy, std = _reference_features(logits, token)
            assert (step.position, step.budget, step.token_id, step.rows) == (pos, 3, token, len(prompts))
            probs = (step.token_prob, step.top1_prob, step.top2_prob)
            assert probs == pytest.approx((prob, top1, top2), rel=RUNNER_RTOL)
            if sid != "plain":  # its controller does not read the spread
                assert tuple(step.spread) == pytest.approx((entropy, std), rel=RUNNER_RTOL)
            else:
                assert math.isnan(step.spread.entropy) and math.isnan(step.spread.logit_std)


def test_fixed_controller_skips_features(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 4, GREEDY, gen(0), FixedController())
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 4) and proposal.steps == []


def test_fixed_controller_drafts_the_whole_budget() -> None:
    controller = make_controller("fixed")
    assert controller.begin_round(5) == 5
    assert controller.begin_round(0) == 0
    step = StepFeatures(position=0, budget=5, token_id=1, token_prob=0.01, top1_prob=0.01, top2_prob=0.01,
                        spread=Spread(entropy=5.0))
    assert controller.on_step(step) is StepDecision.CONTINUE
    with pytest.raises(ValueError, match="unknown controller 'nope'; choose one of: adaspec, fixed, threshold"):
        make_controller("nope")
