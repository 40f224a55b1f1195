"""The draft-model proposer: greedy = argmax decoding, rollback = fresh cache, sampled q exact."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from services.drafter.control import make_controller
from services.drafter.control.base import StepDecision, StepFeatures
from services.drafter.control.fixed import FixedController
from services.drafter.proposers.base import ProposerError
from services.drafter.proposers.draft_model import DraftModelProposer, common_prefix_len
from shared.models import LoadedModel, load_model, make_tiny_family
from shared.protocol import MAX_DRAFT_TOKENS, SamplingParams
from shared.runner import ModelRunner
from shared.sampling import make_generator, probs_from_logits

torch.set_num_threads(1)

PROMPT = [12, 40, 77, 5, 130, 9, 64]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
WARM = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=64, seed=3)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    paths = make_tiny_family(Path(tmp_path_factory.getbasetemp()) / "tiny-family")
    return load_model(paths["draft-L1"])


def make(draft: LoadedModel, **kwargs: Any) -> DraftModelProposer:
    """A proposer on its own runner and KV arena (room for a few full-context sessions)."""
    runner = ModelRunner(draft, 4 * draft.max_model_len * 1024, self_check=False)
    return DraftModelProposer(runner, draft.eos_ids, **kwargs)


def reference_greedy(model: LoadedModel, ids: list[int], k: int) -> list[int]:
    """Argmax decoding with plain transformers calls, no cache: the ground truth."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(k):
            logits = model.model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def test_greedy_proposal_is_argmax_decoding(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposal = proposer.propose("s", 6, GREEDY, make_generator(0))
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 6)
    assert proposal.q is None
    assert proposal.steps == []  # no controller reads features, so none are computed


@pytest.mark.parametrize(
    ("accepted", "with_bonus"), [(0, True), (1, True), (3, True), (5, True), (1, False), (4, False)]
)
def test_proposal_after_rollback_equals_fresh_cache(draft: LoadedModel, accepted: int, with_bonus: bool) -> None:
    """Accept some drafts, then the verifier's own token (absent when a stop cut the round short)."""
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    first = proposer.propose("s", 5, GREEDY, make_generator(0)).token_ids
    bonus = [(first[accepted] + 1) % draft.vocab_size] if accepted < 5 else [17]
    committed_new = first[:accepted] + (bonus if with_bonus else [])
    proposer.commit("s", committed_new, accepted)
    after = proposer.propose("s", 5, GREEDY, make_generator(0)).token_ids

    fresh = make(draft)
    fresh.start("f", PROMPT + committed_new, 64)
    assert after == fresh.propose("f", 5, GREEDY, make_generator(0)).token_ids
    assert after == reference_greedy(draft, PROMPT + committed_new, 5)


def test_cache_keeps_accepted_tokens_and_drops_rejected(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    first = proposer.propose("s", 4, GREEDY, make_generator(0)).token_ids
    # Fed: the prompt, then drafts 0..2 (the last draft's logits were never needed).
    assert proposer.cached_tokens("s") == len(PROMPT) + 3
    proposer.commit("s", [*first[:2], (first[2] + 1) % draft.vocab_size], 2)
    proposer.propose("s", 1, GREEDY, make_generator(0))
    # Rolled back to prompt + 2 accepted drafts, then fed the verifier's token.
    assert proposer.cached_tokens("s") == len(PROMPT) + 3


def test_sampled_proposal_is_deterministic_per_seed_and_matches_fresh_cache(draft: LoadedModel) -> None:
    a = make(draft, mode="sampled", draft_top_k=8)
    a.start("s", PROMPT, 64)
    first = a.propose("s", 4, WARM, make_generator(11)).token_ids
    a.commit("s", [*first[:1], 3], 1)
    after = a.propose("s", 4, WARM, make_generator(12))

    b = make(draft, mode="sampled", draft_top_k=8)
    b.start("s", [*PROMPT, *first[:1], 3], 64)
    fresh = b.propose("s", 4, WARM, make_generator(12))
    assert after.token_ids == fresh.token_ids
    assert after.q is not None and fresh.q is not None
    for qa, qb in zip(after.q, fresh.q, strict=True):
        assert qa.ids == qb.ids
        assert qa.probs == pytest.approx(qb.probs, abs=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=8),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=8),
    SamplingParams(temperature=1.3, top_p=0.5, max_tokens=8),
])
def test_sampled_q_is_the_truncated_request_distribution(draft: LoadedModel, params: SamplingParams) -> None:
    top_k = 8
    proposer = make(draft, mode="sampled", draft_top_k=top_k)
    proposer.start("s", PROMPT, 64)
    proposal = proposer.propose("s", 4, params, make_generator(5))
    assert proposal.q is not None and len(proposal.q) == len(proposal.token_ids) == 4
    seq = list(PROMPT)
    for token, q in zip(proposal.token_ids, proposal.q, strict=True):
        assert token in q.ids
        assert abs(sum(q.probs) - 1.0) < 1e-3
        assert all(0.0 < p <= 1.0 for p in q.probs)
        assert len(set(q.ids)) == len(q.ids) <= top_k
        with torch.inference_mode():
            logits = draft.model(input_ids=torch.tensor([seq])).logits[0, -1]
        full = probs_from_logits(logits, params)
        expected = full.topk(top_k)
        keep = expected.values > 0
        assert q.ids == expected.indices[keep].tolist()
        renorm = expected.values[keep] / expected.values[keep].sum()
        assert q.probs == pytest.approx(renorm.tolist(), abs=1e-5)
        seq.append(token)


def test_sampled_tokens_follow_q(draft: LoadedModel) -> None:
    proposer = make(draft, mode="sampled", draft_top_k=4)
    proposer.start("s", PROMPT, 64)
    gen = make_generator(99)
    draws = 1500
    counts: Counter[int] = Counter()
    q = None
    for _ in range(draws):  # same committed state each time: the cache re-feeds only the last token
        proposal = proposer.propose("s", 1, SamplingParams(temperature=1.0), gen)
        counts[proposal.token_ids[0]] += 1
        q = proposal.q[0] if proposal.q else None
    assert q is not None
    tv = 0.5 * sum(abs(counts[i] / draws - p) for i, p in zip(q.ids, q.probs, strict=True))
    assert tv < 0.06, f"empirical draft frequencies are {tv:.3f} away from q in total variation"


def test_temperature_zero_drafts_greedily_even_in_sampled_mode(draft: LoadedModel) -> None:
    proposer = make(draft, mode="sampled")
    proposer.start("s", PROMPT, 64)
    proposal = proposer.propose("s", 3, GREEDY, make_generator(0))
    assert proposal.q is None
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 3)


class _StopAt:
    """A controller that stops (keeping or discarding the token) at a given position."""

    name = "stop-at"
    wants_features = True

    def __init__(self, position: int, decision: StepDecision) -> None:
        self.position, self.decision = position, decision
        self.seen: list[StepFeatures] = []

    def begin_round(self, budget: int) -> int:
        return budget

    def on_step(self, step: StepFeatures) -> StepDecision:
        self.seen.append(step)
        return self.decision if step.position == self.position else StepDecision.CONTINUE

    def end_round(self, drafted: int, accepted: int) -> None:
        pass


@pytest.mark.parametrize(("decision", "expected_len"), [(StepDecision.STOP, 3), (StepDecision.DISCARD, 2)])
def test_controller_can_stop_drafting(draft: LoadedModel, decision: StepDecision, expected_len: int) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    controller = _StopAt(2, decision)
    proposal = proposer.propose("s", 6, GREEDY, make_generator(0), controller)
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 6)[:expected_len]
    assert [s.position for s in controller.seen] == [0, 1, 2]


def test_step_features_describe_the_draft_distribution(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposal = proposer.propose("s", 4, GREEDY, make_generator(0), _StopAt(99, StepDecision.CONTINUE))
    assert len(proposal.steps) == 4
    for pos, (token, step) in enumerate(zip(proposal.token_ids, proposal.steps, strict=True)):
        assert (step.position, step.budget, step.token_id) == (pos, 4, token)
        assert step.token_prob == pytest.approx(step.top1_prob)  # greedy drafts the top-1 token
        assert 0.0 <= step.top2_prob <= step.top1_prob <= 1.0
        assert step.margin >= 0.0
        assert 0.0 <= step.entropy <= float(torch.log(torch.tensor(draft.vocab_size)))


def test_fixed_controller_skips_features(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposal = proposer.propose("s", 4, GREEDY, make_generator(0), FixedController())
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 4) and proposal.steps == []


def test_a_full_draft_kv_cache_disables_drafting_not_the_session(draft: LoadedModel) -> None:
    runner = ModelRunner(draft, 100 * 1024, self_check=False)  # room for ~100 tokens in all
    proposer = DraftModelProposer(runner, draft.eos_ids)
    proposer.start("big", PROMPT, 500)
    assert proposer.propose("big", 4, GREEDY, make_generator(0)).token_ids == []
    proposer.start("small", PROMPT, 8)
    assert len(proposer.propose("small", 4, GREEDY, make_generator(0)).token_ids) == 4
    proposer.close("small")
    assert runner.kv.reserved_tokens == 0


def test_fixed_controller_drafts_the_whole_budget() -> None:
    controller = make_controller("fixed")
    assert controller.begin_round(5) == 5
    assert controller.begin_round(0) == 0
    step = StepFeatures(position=0, budget=5, token_id=1, token_prob=0.01, top1_prob=0.01, top2_prob=0.01,
                        entropy=5.0)
    assert controller.on_step(step) is StepDecision.CONTINUE
    with pytest.raises(ValueError, match="unknown controller 'nope'; choose one of: fixed"):
        make_controller("nope")


def test_draft_length_is_clamped_to_context_and_wire_limit(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("long", [5 + i % 300 for i in range(draft.max_model_len - 3)], 64)
    assert len(proposer.propose("long", 10, GREEDY, make_generator(0)).token_ids) == 3
    proposer.start("s", PROMPT, 64)
    assert len(proposer.propose("s", MAX_DRAFT_TOKENS + 10, GREEDY, make_generator(0)).token_ids) == MAX_DRAFT_TOKENS
    assert proposer.propose("s", 0, GREEDY, make_generator(0)).token_ids == []


def test_out_of_vocabulary_tokens_disable_drafting_not_the_session(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposer.commit("s", [draft.vocab_size + 5], 0)
    assert proposer.propose("s", 4, GREEDY, make_generator(0)).token_ids == []


def test_unknown_session_and_bad_settings_are_refused(draft: LoadedModel) -> None:
    proposer = make(draft)
    with pytest.raises(ProposerError, match="no draft session 'ghost'"):
        proposer.propose("ghost", 3, GREEDY, make_generator(0))
    proposer.close("ghost")  # idempotent
    with pytest.raises(ValueError, match="draft_mode must be one of greedy, sampled"):
        make(draft, mode="beam")
    with pytest.raises(ValueError, match="draft_top_k must be in"):
        make(draft, mode="sampled", draft_top_k=0)


@pytest.mark.parametrize(("a", "b", "n"), [([], [], 0), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 9], 1), ([4], [5], 0)])
def test_common_prefix_len(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix_len(a, b) == n


def test_drafting_stops_after_an_end_token(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    expected = reference_greedy(draft, PROMPT, 5)
    stop_at = SamplingParams(temperature=0.0, stop_token_ids=[expected[1]])
    assert proposer.propose("s", 5, stop_at, make_generator(0)).token_ids == expected[:2]
