"""The draft-model proposer: greedy = argmax decoding, rollback = fresh cache, sampled q exact,
a batch of sessions = each session alone. Its step features and controllers: test_draft_features."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import pytest
import torch

from services.drafter.batcher import DraftBatcher
from services.drafter.control.base import StepDecision
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import EMPTY_PROPOSAL, DraftJob, JobSession, ProposerError
from services.drafter.proposers.draft_model import DraftModelProposer
from services.drafter.worker import ComputeWorker
from shared.draft_q import Nucleus, dense, read
from shared.models import LoadedModel
from shared.penalties import apply_penalties
from shared.protocol import MAX_DRAFT_TOKENS, SamplingParams
from shared.runner import ModelRunner
from shared.sampling import probs_from_logits
from tests.unit.draft_proposer_support import (
    BATCH_PROMPTS,
    FULL_GREEDY,
    GREEDY,
    PROMPT,
    WARM,
    StopAt,
    gen,
    make,
    propose,
    reference_draft,
    reference_greedy,
    reference_logits,
    tiny_draft,
)

torch.set_num_threads(1)

FP16_RTOL = 2e-3  # float16 keeps 11 significant bits; renormalising adds one more rounding


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_draft(tmp_path_factory)


def test_greedy_proposal_is_argmax_decoding(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 6, GREEDY, gen(0))
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 6)
    assert proposal.q is None
    assert proposal.steps == []  # no controller reads features, so none are computed


@pytest.mark.parametrize("tail", [[90, 91, 92], [90], "a's draft"])
def test_a_first_draft_copies_the_rows_another_session_holds(draft: LoadedModel, tail: list[int] | str) -> None:
    """A session whose prompt starts as another's text does: its first draft copies that session's
    rows of the common part (a's drafted rows too: a row depends only on the tokens up to it),
    computes only the rest, and drafts what it drafts alone, also once a's rows are gone."""
    proposer = make(draft)
    proposer.start("a", PROMPT, 64)
    sent = propose(proposer, "a", 3, FULL_GREEDY, gen(0)).token_ids
    prompt = [*PROMPT, sent[0], 90] if tail == "a's draft" else [*PROMPT[:-1], *tail]
    proposer.start("b", prompt, 64)
    assert propose(proposer, "b", 4, FULL_GREEDY, gen(0)).token_ids == reference_greedy(draft, prompt, 4)
    assert proposer.shared_prefix_tokens == (len(PROMPT) + 1 if tail == "a's draft" else len(PROMPT) - 1)
    proposer.close("a")  # kept for its rows, until another closed session takes its place
    proposer.start("c", [200, 14, 3], 64)
    propose(proposer, "c", 2, GREEDY, gen(0))
    proposer.close("c")
    proposer.commit("b", [5], 0)
    assert propose(proposer, "b", 4, FULL_GREEDY, gen(0)).token_ids == reference_greedy(draft, [*prompt, 5], 4)


@pytest.mark.asyncio
async def test_the_batcher_counts_the_rows_its_proposer_took_from_other_sessions(draft: LoadedModel) -> None:
    metrics = DrafterMetrics()
    proposer = make(draft)
    batcher = DraftBatcher(proposer, ComputeWorker(inline=True), metrics)
    task = asyncio.create_task(batcher.run())
    try:
        for sid in ("a", "b"):
            proposer.start(sid, PROMPT, 64)
            await batcher.propose(DraftJob(JobSession(sid, GREEDY, gen(0)), 2))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert metrics.shared_prefix._value.get() == proposer.shared_prefix_tokens == len(PROMPT) - 1


@pytest.mark.parametrize("share", [True, False])
def test_one_request_after_another_shares_the_prompt_rows(draft: LoadedModel, share: bool) -> None:
    """The last closed session's cache is kept as a donor: the next request's first draft copies
    the prompt rows both have, and drafts what it drafts alone. ``--share-prefixes false`` (the
    baseline) frees it and computes every row."""
    proposer = make(draft, share_prefixes=share)
    proposer.start("a", PROMPT, 64)
    propose(proposer, "a", 3, GREEDY, gen(0))
    proposer.close("a")
    assert (proposer.runner.kv.reserved_tokens > 0) is share
    prompt = [*PROMPT[:-1], 90, 91]
    proposer.start("b", prompt, 64)
    assert propose(proposer, "b", 4, FULL_GREEDY, gen(0)).token_ids == reference_greedy(draft, prompt, 4)
    assert proposer.shared_prefix_tokens == (len(PROMPT) - 1 if share else 0)


def test_greedy_mode_sends_ids_only_at_any_temperature(draft: LoadedModel) -> None:
    proposer = make(draft, mode="greedy")
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 4, WARM, gen(0))
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 4)
    assert proposal.q is None


@pytest.mark.parametrize(
    ("accepted", "with_bonus"), [(0, True), (1, True), (3, True), (5, True), (1, False), (4, False)]
)
def test_proposal_after_rollback_equals_fresh_cache(draft: LoadedModel, accepted: int, with_bonus: bool) -> None:
    """Accept some drafts, then the verifier's own token (absent when a stop cut the round short)."""
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    first = propose(proposer, "s", 5, GREEDY, gen(0)).token_ids
    bonus = [(first[accepted] + 1) % draft.vocab_size] if accepted < 5 else [17]
    committed_new = first[:accepted] + (bonus if with_bonus else [])
    proposer.commit("s", committed_new, accepted)
    after = propose(proposer, "s", 5, GREEDY, gen(0)).token_ids

    fresh = make(draft)
    fresh.start("f", PROMPT + committed_new, 64)
    assert after == propose(fresh, "f", 5, GREEDY, gen(0)).token_ids
    assert after == reference_greedy(draft, PROMPT + committed_new, 5)


def test_cache_keeps_accepted_tokens_and_drops_rejected(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    first = propose(proposer, "s", 4, GREEDY, gen(0)).token_ids
    # Fed: the prompt, then drafts 0..2 (the last draft's logits were never needed).
    assert proposer.cached_tokens("s") == len(PROMPT) + 3
    proposer.commit("s", [*first[:2], (first[2] + 1) % draft.vocab_size], 2)
    propose(proposer, "s", 1, GREEDY, gen(0))
    # Rolled back to prompt + 2 accepted drafts, then fed the verifier's token.
    assert proposer.cached_tokens("s") == len(PROMPT) + 3


# --- batches ------------------------------------------------------------------------------------

def test_a_batch_drafts_each_session_as_if_it_were_alone(draft: LoadedModel) -> None:
    """Different prompt lengths, different k, then different rollbacks: the batch changes nothing."""
    batched = make(draft)
    alone = {sid: make(draft) for sid in BATCH_PROMPTS}
    for sid, prompt in BATCH_PROMPTS.items():
        batched.start(sid, prompt, 64)
        alone[sid].start(sid, prompt, 64)
    committed = {sid: list(prompt) for sid, prompt in BATCH_PROMPTS.items()}

    ks = {"a": 5, "b": 2, "c": 7}
    got = batched.propose([DraftJob(JobSession(sid, GREEDY, gen(0)), k) for sid, k in ks.items()])
    for sid, proposal in zip(ks, got, strict=True):
        assert proposal.token_ids == propose(alone[sid], sid, ks[sid], GREEDY, gen(0)).token_ids
        assert proposal.token_ids == reference_draft(draft, committed[sid], ks[sid])
        assert proposal.q is None

    # Round two: "a" accepts 2 and gets a bonus, "b" accepts all, "c" accepts none. Now one
    # session feeds a rolled-back token, one two tokens, one a single new one, in another order.
    drafts = {sid: p.token_ids for sid, p in zip(ks, got, strict=True)}
    new = {"a": [*drafts["a"][:2], (drafts["a"][2] + 1) % draft.vocab_size], "b": [*drafts["b"], 17],
           "c": [(drafts["c"][0] + 1) % draft.vocab_size]}
    accepted = {"a": 2, "b": 2, "c": 0}
    for sid in BATCH_PROMPTS:
        batched.commit(sid, new[sid], accepted[sid])
        alone[sid].commit(sid, new[sid], accepted[sid])
        committed[sid] += new[sid]
    ks = {"c": 3, "a": 6, "b": 4}
    got = batched.propose([DraftJob(JobSession(sid, GREEDY, gen(0)), k) for sid, k in ks.items()])
    for sid, proposal in zip(ks, got, strict=True):
        assert proposal.token_ids == propose(alone[sid], sid, ks[sid], GREEDY, gen(0)).token_ids
        assert proposal.token_ids == reference_draft(draft, committed[sid], ks[sid])


def test_a_sampled_session_in_a_batch_draws_what_it_draws_alone(draft: LoadedModel) -> None:
    """Each session samples with its own generator: batching with a greedy one changes nothing."""
    batched, alone = make(draft), make(draft)
    for p in (batched, alone):
        p.start("warm", PROMPT, 64)
        p.start("cold", BATCH_PROMPTS["b"], 64)
    warm, cold = batched.propose([DraftJob(JobSession("warm", WARM, gen(7)), 5), DraftJob(JobSession("cold", GREEDY,
                                                                                                     gen(0)), 3)])
    warm_alone = propose(alone, "warm", 5, WARM, gen(7))
    assert warm.token_ids == warm_alone.token_ids
    assert warm.q is not None and warm_alone.q is not None
    for qa, qb in zip(warm.q, warm_alone.q, strict=True):
        (ids_a, probs_a), (ids_b, probs_b) = read(qa), read(qb)
        assert ids_a.tolist() == ids_b.tolist()
        torch.testing.assert_close(probs_a, probs_b, rtol=FP16_RTOL, atol=1e-6)
    assert cold.q is None and cold.token_ids == reference_greedy(draft, BATCH_PROMPTS["b"], 3)


def test_sessions_leaving_the_batch_early_do_not_stop_the_others(draft: LoadedModel) -> None:
    proposer = make(draft)
    for sid, prompt in BATCH_PROMPTS.items():
        proposer.start(sid, prompt, 64)
    end = reference_greedy(draft, BATCH_PROMPTS["b"], 2)[1]
    controller = StopAt(0, StepDecision.STOP)
    a, b, c = proposer.propose([
        DraftJob(JobSession("a", GREEDY, gen(0)), 6, controller=controller),  # the controller stops it after one token
        DraftJob(JobSession("b", SamplingParams(temperature=0.0, stop_token_ids=[end]), gen(0)), 6),  # ends at its 2nd
        DraftJob(JobSession("c", SamplingParams(temperature=0.0, ignore_eos=True), gen(0)), 6),  # drafts all 6
    ])
    assert a.token_ids == reference_greedy(draft, BATCH_PROMPTS["a"], 1)
    assert [s.position for s in controller.seen] == [0]
    assert b.token_ids == reference_greedy(draft, BATCH_PROMPTS["b"], 2)
    assert c.token_ids == reference_greedy(draft, BATCH_PROMPTS["c"], 6)


def test_an_unknown_or_closed_session_gets_an_empty_proposal_and_the_rest_are_drafted(
        draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("a", BATCH_PROMPTS["a"], 64)
    proposer.start("gone", BATCH_PROMPTS["b"], 64)
    proposer.start("c", BATCH_PROMPTS["c"], 64)
    proposer.close("gone")  # closed while its job waited
    got = proposer.propose([DraftJob(JobSession("a", GREEDY, gen(0)), 3), DraftJob(JobSession("ghost", GREEDY, gen(0)),
                                                                                   3),
                            DraftJob(JobSession("gone", GREEDY, gen(0)), 3), DraftJob(JobSession("c", GREEDY, gen(0)),
                                                                                      4)])
    assert got[1] == got[2] == EMPTY_PROPOSAL
    assert got[0].token_ids == reference_greedy(draft, BATCH_PROMPTS["a"], 3)
    assert got[3].token_ids == reference_greedy(draft, BATCH_PROMPTS["c"], 4)
    assert proposer.propose([]) == []


# --- sampled drafts -----------------------------------------------------------------------------

def test_sampled_proposal_is_deterministic_per_seed_and_matches_fresh_cache(draft: LoadedModel) -> None:
    nucleus = Nucleus(mass=0.95, max_entries=8)
    a = make(draft, mode="sampled", nucleus=nucleus)
    a.start("s", PROMPT, 64)
    first = propose(a, "s", 4, WARM, gen(11)).token_ids
    a.commit("s", [*first[:1], 3], 1)
    after = propose(a, "s", 4, WARM, gen(12))

    b = make(draft, mode="sampled", nucleus=nucleus)
    b.start("s", [*PROMPT, *first[:1], 3], 64)
    fresh = propose(b, "s", 4, WARM, gen(12))
    assert after.token_ids == fresh.token_ids
    assert after.q is not None and fresh.q is not None
    for qa, qb in zip(after.q, fresh.q, strict=True):
        (ids_a, probs_a), (ids_b, probs_b) = read(qa), read(qb)
        assert ids_a.tolist() == ids_b.tolist()
        torch.testing.assert_close(probs_a, probs_b, rtol=FP16_RTOL, atol=1e-6)


def nucleus_of(probs: torch.Tensor, nucleus: Nucleus) -> tuple[list[int], torch.Tensor]:
    """The expected nucleus, written out: most likely first, until the mass or the cap."""
    values, ids = probs.double().sort(descending=True)
    keep = 1
    while keep < min(nucleus.max_entries, len(values)) and float(values[:keep].sum()) < nucleus.mass:
        keep += 1
    values, ids = values[:keep], ids[:keep]
    nonzero = values > 0
    return ids[nonzero].tolist(), values[nonzero]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=8),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=8),
    SamplingParams(temperature=1.3, top_p=0.5, max_tokens=8),
])
@pytest.mark.parametrize("nucleus", [Nucleus(mass=0.9, max_entries=1024), Nucleus(mass=0.99, max_entries=8)])
def test_sampled_q_is_the_request_distributions_nucleus(draft: LoadedModel, params: SamplingParams,
                                                        nucleus: Nucleus) -> None:
    proposer = make(draft, mode="sampled", nucleus=nucleus)
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 4, params, gen(5))
    assert proposal.q is not None and len(proposal.q) == len(proposal.token_ids) == 4
    seq = list(PROMPT)
    for token, q in zip(proposal.token_ids, proposal.q, strict=True):
        ids, probs = read(q)
        assert token in ids.tolist()
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
        assert bool((probs > 0).all()) and bool((probs <= 1).all())
        assert len(set(ids.tolist())) == len(ids) <= nucleus.max_entries
        want_ids, want = nucleus_of(probs_from_logits(reference_logits(draft, seq), params), nucleus)
        assert ids.tolist() == want_ids
        torch.testing.assert_close(probs, want / want.sum(), rtol=FP16_RTOL, atol=1e-6)
        seq.append(token)


def test_sampled_q_with_the_whole_nucleus_is_the_request_distribution(draft: LoadedModel) -> None:
    """mass=1 and room for the whole vocabulary: q is the warped distribution itself."""
    nucleus = Nucleus(mass=1.0, max_entries=4096)
    assert draft.vocab_size <= nucleus.max_entries
    proposer = make(draft, mode="sampled", nucleus=nucleus)
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 4, WARM, gen(21))
    assert proposal.q is not None and len(proposal.q) == len(proposal.token_ids) == 4
    seq = list(PROMPT)
    for token, q in zip(proposal.token_ids, proposal.q, strict=True):
        ids, probs = read(q)
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
        assert token in ids.tolist() and len(ids) <= nucleus.max_entries
        want = probs_from_logits(reference_logits(draft, seq), WARM)
        # float16 keeps ~3 significant digits and flushes entries below ~6e-8 to 0 (left out)
        torch.testing.assert_close(dense(q, draft.vocab_size), want, rtol=FP16_RTOL, atol=1e-6)
        seq.append(token)


def test_sampled_tokens_follow_q(draft: LoadedModel) -> None:
    proposer = make(draft, mode="sampled", nucleus=Nucleus(mass=1.0, max_entries=4))
    proposer.start("s", PROMPT, 64)
    rng = gen(99)
    draws = 1500
    counts: Counter[int] = Counter()
    q = None
    for _ in range(draws):  # same committed state each time: the cache re-feeds only the last token
        proposal = propose(proposer, "s", 1, SamplingParams(temperature=1.0), rng)
        counts[proposal.token_ids[0]] += 1
        q = proposal.q[0] if proposal.q else None
    assert q is not None
    ids, probs = read(q)
    assert len(ids) == 4 and set(counts) <= set(ids.tolist())
    tv = 0.5 * sum(abs(counts[i] / draws - p) for i, p in zip(ids.tolist(), probs.tolist(), strict=True))
    assert tv < 0.06, f"empirical draft frequencies are {tv:.3f} away from q in total variation"


def test_temperature_zero_drafts_greedily_even_in_sampled_mode(draft: LoadedModel) -> None:
    proposer = make(draft, mode="sampled")
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 3, GREEDY, gen(0))
    assert proposal.q is None
    assert proposal.token_ids == reference_greedy(draft, PROMPT, 3)


def test_sampled_is_the_default_mode(draft: LoadedModel) -> None:
    proposer = make(draft)
    assert proposer.mode == "sampled" and proposer.nucleus == Nucleus(mass=0.98, max_entries=4096)
    proposer.start("s", PROMPT, 64)
    proposal = propose(proposer, "s", 2, WARM, gen(0))
    assert proposal.q is not None and len(proposal.q) == 2


# --- limits and refusals --------------------------------------------------------------------------

def test_a_full_draft_kv_cache_disables_drafting_not_the_session(draft: LoadedModel) -> None:
    runner = ModelRunner(draft, 100 * 1024, self_check=False)  # room for ~100 tokens in all
    proposer = DraftModelProposer(runner, draft.eos_ids)
    proposer.start("big", PROMPT, 500)
    assert propose(proposer, "big", 4, GREEDY, gen(0)).token_ids == []
    proposer.start("small", PROMPT, 8)
    assert len(propose(proposer, "small", 4, GREEDY, gen(0)).token_ids) == 4
    # in one batch too: the session without a slot drafts nothing, the other drafts
    big, small = proposer.propose([DraftJob(JobSession("big", GREEDY, gen(0)), 4), DraftJob(JobSession("small", GREEDY,
                                                                                                       gen(0)), 4)])
    assert big.token_ids == [] and len(small.token_ids) == 4
    proposer.close("small")  # its cache stays as a prompt donor ...
    kept = runner.kv.reserved_tokens
    assert kept > 0
    need = runner.kv.tokens - kept + 1  # ... until a session needs its room: one token more than is free
    proposer.start("next", PROMPT, need - len(PROMPT) - MAX_DRAFT_TOKENS)
    assert len(propose(proposer, "next", 4, GREEDY, gen(0)).token_ids) == 4
    assert runner.kv.reserved_tokens == need and proposer.shared_prefix_tokens == 0


def test_draft_length_is_clamped_to_context_and_wire_limit(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("long", [5 + i % 300 for i in range(draft.max_model_len - 3)], 64)
    assert len(propose(proposer, "long", 10, GREEDY, gen(0)).token_ids) == 3
    proposer.start("s", PROMPT, 64)
    assert len(propose(proposer, "s", MAX_DRAFT_TOKENS + 10, GREEDY, gen(0)).token_ids) == MAX_DRAFT_TOKENS
    assert propose(proposer, "s", 0, GREEDY, gen(0)).token_ids == []


def test_out_of_vocabulary_tokens_disable_drafting_not_the_session(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    proposer.commit("s", [draft.vocab_size + 5], 0)
    assert propose(proposer, "s", 4, GREEDY, gen(0)).token_ids == []


def test_unknown_session_and_bad_settings_are_refused(draft: LoadedModel) -> None:
    proposer = make(draft)
    assert propose(proposer, "ghost", 3, GREEDY, gen(0)) == EMPTY_PROPOSAL  # a job for it drafts nothing
    with pytest.raises(ProposerError, match="no draft session 'ghost'"):
        proposer.commit("ghost", [1], 0)
    with pytest.raises(ProposerError, match="no draft session 'ghost'"):
        proposer.cached_tokens("ghost")
    proposer.close("ghost")  # idempotent
    with pytest.raises(ValueError, match="draft_mode must be one of sampled, greedy, got 'beam'"):
        make(draft, mode="beam")
    with pytest.raises(ValueError, match=r"the q nucleus mass must be in \(0, 1\], got 0.0"):
        make(draft, mode="sampled", nucleus=Nucleus(mass=0.0))
    with pytest.raises(ValueError, match=r"the q nucleus size must be in \[1, 4096\], got 0"):
        make(draft, mode="sampled", nucleus=Nucleus(max_entries=0))


def test_drafting_stops_after_an_end_token(draft: LoadedModel) -> None:
    proposer = make(draft)
    proposer.start("s", PROMPT, 64)
    expected = reference_greedy(draft, PROMPT, 5)
    stop_at = SamplingParams(temperature=0.0, stop_token_ids=[expected[1]])
    assert propose(proposer, "s", 5, stop_at, gen(0)).token_ids == expected[:2]


PENALISED = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "logit_bias": {7: 5.0}}


def penalised_row(model: LoadedModel, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The reference: plain transformers logits after prompt + output, penalised as the verifier does."""
    return apply_penalties(reference_logits(model, [*prompt, *output]).unsqueeze(0), params, prompt, output)[0]


@pytest.mark.parametrize("committed", [0, 3])
def test_a_greedy_request_with_penalties_is_drafted_from_penalised_logits(draft: LoadedModel, committed: int) -> None:
    """Drafted as the target would decode it (the draft model stands in for the target here): each
    draft token is the argmax of its row penalised with the committed output and the drafts before it
    counted as generated, never the prompt. Without penalties the drafts differ (the case is not moot)."""
    params = SamplingParams(temperature=0.0, max_tokens=64, **PENALISED)  # type: ignore[arg-type]
    output = reference_greedy(draft, PROMPT, committed)  # committed output the session resumes after
    proposer = make(draft)
    proposer.start("s", [*PROMPT, *output], 64)
    proposal = proposer.propose([DraftJob(JobSession("s", params, gen(1), prompt_len=len(PROMPT)), 8)])[0]
    want = list(output)
    for _ in range(8):
        want.append(int(penalised_row(draft, PROMPT, want, params).argmax()))
    assert proposal.token_ids == want[committed:]
    plain = propose(proposer, "s", 8, GREEDY, gen(1))
    assert plain.token_ids != proposal.token_ids


def test_a_sampled_request_with_penalties_sends_the_penalised_q(draft: LoadedModel) -> None:
    params = SamplingParams(temperature=0.9, max_tokens=64, seed=3, **PENALISED)  # type: ignore[arg-type]
    proposer = make(draft, mode="sampled", nucleus=Nucleus(mass=1.0, max_entries=4096))
    proposer.start("s", PROMPT, 64)
    proposal = proposer.propose([DraftJob(JobSession("s", params, gen(8), prompt_len=len(PROMPT)), 4)])[0]
    assert proposal.q is not None and len(proposal.q) == 4
    output: list[int] = []
    for token, q in zip(proposal.token_ids, proposal.q, strict=True):
        want = probs_from_logits(penalised_row(draft, PROMPT, output, params), params)
        torch.testing.assert_close(dense(q, draft.vocab_size), want, rtol=FP16_RTOL, atol=1e-6)
        output.append(token)
