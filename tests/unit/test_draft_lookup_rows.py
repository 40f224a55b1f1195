"""Looked-up rows (``DraftModelProposer(lookup_rows=N)``): a greedy (or raced) draft step also feeds the tokens
prompt lookup guesses come next, and keeps those the draft model drafts too. The draft is the one
drafting token by token gives, in fewer forwards, and the cache holds no row of a dropped guess."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.drafter.control.base import StepDecision
from services.drafter.proposers.base import DraftJob, JobSession, Proposal
from services.drafter.proposers.draft_model import DraftModelProposer
from shared.models import LoadedModel
from shared.protocol import SamplingParams
from tests.unit.draft_proposer_support import FULL_GREEDY, WARM, StopAt, gen, make, reference_greedy, tiny_draft

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_draft(tmp_path_factory)


@pytest.fixture(scope="module")
def looping(draft: LoadedModel) -> list[int]:
    """A prompt the draft model continues as it went on before: after [200, 14] the tiny draft
    falls into the loop 190 193 197, so prompt lookup finds what it will draft."""
    return [200, 14, *reference_greedy(draft, [200, 14], 20)]


class Counting:
    """Counts a runner's forwards (and the rows they feed)."""

    def __init__(self, proposer: DraftModelProposer) -> None:
        self.forwards = self.rows = 0
        inner = proposer.runner.forward

        def forward(segments: Any) -> Any:
            self.forwards += 1
            self.rows += sum(len(s.tokens) for s in segments)
            return inner(segments)

        proposer.runner.forward = forward  # type: ignore[method-assign]


def job(session: str, k: int, params: SamplingParams = FULL_GREEDY, spare: int = 0, **kw: Any) -> DraftJob:
    return DraftJob(JobSession(session, params, gen(0)), k, spare=spare, **kw)


def one(proposer: DraftModelProposer, j: DraftJob) -> Proposal:
    return proposer.propose([j])[0]


@pytest.mark.parametrize("rows", [1, 3])
def test_a_draft_with_looked_up_rows_is_the_draft_without_in_fewer_forwards(draft: LoadedModel, looping: list[int],
                                                                           rows: int) -> None:
    plain, looked = make(draft), make(draft, lookup_rows=rows)
    counts = {}
    for proposer in (plain, looked):
        proposer.start("s", looping, 64)
        counts[proposer] = Counting(proposer)
        got = one(proposer, job("s", 12)).token_ids
        assert got == reference_greedy(draft, looping, 12)
    assert looked.looked_up_kept > 0 and looked.looked_up >= looked.looked_up_kept
    assert counts[looked].forwards == counts[plain].forwards - looked.looked_up_kept
    assert plain.looked_up == 0


def test_the_cache_keeps_no_row_of_a_dropped_guess(draft: LoadedModel, looping: list[int]) -> None:
    """After drafts whose guesses were partly dropped, and a verdict that keeps only some of the
    draft, the next drafts are still the model's own (a stale row would change them)."""
    p = make(draft, lookup_rows=3)
    p.start("s", looping, 64)
    sent = one(p, job("s", 8)).token_ids
    assert p.cached_tokens("s") == len(looping) + len(sent) - 1  # every kept token but the last, unfed
    p.commit("s", [*sent[:3], 7], 3)  # three accepted, then the verifier's own token
    context = [*looping, *sent[:3], 7]
    assert one(p, job("s", 8)).token_ids == reference_greedy(draft, context, 8)


def test_a_lookahead_step_takes_the_tokens_that_come_free(draft: LoadedModel, looping: list[int]) -> None:
    """k=1 with spare tokens (a lookahead drafted a token a batch): the step's token, and up to
    ``spare`` more when guessed right; never more."""
    p = make(draft, lookup_rows=3)
    p.start("s", looping, 64)
    want = reference_greedy(draft, looping, 4)
    got = one(p, job("s", 1, spare=3)).token_ids
    assert 1 <= len(got) <= 4 and got == want[: len(got)]
    assert len(got) > 1  # the looping prompt guesses right
    p2 = make(draft, lookup_rows=3)
    p2.start("s", looping, 64)
    assert one(p2, job("s", 1)).token_ids == want[:1]  # no spare: one token, as before


@pytest.mark.parametrize(("temperature", "kept"), [(0.1, True), (1.0, False)])
def test_a_raced_draft_with_looked_up_rows_is_the_raced_draft_without(draft: LoadedModel, looping: list[int],
                                                                       temperature: float, kept: bool) -> None:
    """A keyed race's winner depends only on its row's logits and position: a guess that wins its race is
    kept, and the draft (tokens and runner-ups) is the one drafting token by token gives. At temperature 0.1
    the loop's tokens win their races, so guesses are kept; at 1 the tiny draft's races leave the loop."""
    params = SamplingParams(temperature=temperature, max_tokens=64, seed=5)
    plain, looked = make(draft), make(draft, lookup_rows=3)
    got, counts = {}, {}
    for proposer in (plain, looked):
        proposer.start("s", looping, 64)
        counts[proposer] = Counting(proposer)
        got[proposer] = one(proposer, DraftJob(JobSession("s", params, gen(0), race_key=99), 12))
    assert got[looked].token_ids == got[plain].token_ids
    assert got[looked].runner_up == got[plain].runner_up and got[looked].q is None
    assert looked.looked_up > 0 and (looked.looked_up_kept > 0) is kept
    assert counts[looked].forwards == counts[plain].forwards - looked.looked_up_kept


@pytest.mark.parametrize("case", ["sampled", "watched", "k=1"])
def test_no_rows_are_looked_up_where_a_step_must_be_its_own(draft: LoadedModel, looping: list[int],
                                                             case: str) -> None:
    """A sampled row draws from its stream, a watched one is screened token by token, and a step
    with no room for a second token has nothing to gain: none feeds guesses."""
    p = make(draft, lookup_rows=3)
    p.start("s", looping, 64)
    j = {"sampled": job("s", 6, WARM), "watched": job("s", 6, controller=StopAt(99, StepDecision.CONTINUE)),
         "k=1": job("s", 1)}[case]
    one(p, j)
    assert p.looked_up == 0


def test_an_end_token_ends_the_draft_even_when_guessed(draft: LoadedModel, looping: list[int]) -> None:
    """The guessed rows never carry a draft past an end token."""
    want = reference_greedy(draft, looping, 12)
    end = want[5]
    p = make(draft, lookup_rows=3)
    p.start("s", looping, 64)
    params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[end])
    got = one(p, job("s", 12, params))
    assert got.token_ids == want[: want.index(end) + 1] and got.final


def test_a_dropped_guess_leaves_no_row_in_the_slot(draft: LoadedModel, looping: list[int]) -> None:
    """The prompt's last two tokens occurred last before a stray 77, so prompt lookup guesses 77,
    which the model does not draft: the guess is fed and dropped, and the slot is cut back to the
    rows it keeps."""
    altered = [*looping, 77, *looping[-2:]]
    p = make(draft, lookup_rows=3)
    p.start("s", altered, 64)
    got = one(p, job("s", 10)).token_ids
    assert got == reference_greedy(draft, altered, 10)
    assert p.looked_up > p.looked_up_kept
    main = p._sessions["s"].caches.main
    assert main is not None and main.slot.length == len(main.cached) == len(altered) + len(got) - 1


def test_sessions_with_and_without_guesses_draft_together_as_each_alone(draft: LoadedModel, looping: list[int]) -> None:
    """One batch: a session with guesses, one with none to make (a fresh prompt), and a sampled one."""
    p = make(draft, lookup_rows=3)
    prompts = {"loop": looping, "plain": [9, 9, 130, 64, 3], "warm": [12, 40, 77]}
    for sid, prompt in prompts.items():
        p.start(sid, prompt, 64)
    jobs = [job("loop", 8), job("plain", 5), job("warm", 4, WARM)]
    got = p.propose(jobs)
    assert got[0].token_ids == reference_greedy(draft, looping, 8)
    assert got[1].token_ids == reference_greedy(draft, prompts["plain"], 5)
    assert len(got[2].token_ids) == 4 and got[2].q is not None and len(got[2].q) == 4
    assert p.looked_up_kept > 0


@pytest.mark.parametrize("spare", [0, 1, 2])
def test_a_step_never_takes_more_than_its_spare(draft: LoadedModel, looping: list[int], spare: int) -> None:
    p = make(draft, lookup_rows=3)
    p.start("s", looping, 64)
    got = one(p, job("s", 1, spare=spare)).token_ids
    assert got == reference_greedy(draft, looping, 1 + spare)  # the loop is guessed right: all of them


@pytest.mark.parametrize("rows", [1, 3])
def test_a_row_that_only_sends_its_features_keeps_its_guesses_each_with_its_own_features(
        draft: LoadedModel, looping: list[int], rows: int) -> None:
    """``--send-confidence`` (features read by the verifier, no controller watching): the draft and every
    token's probabilities are those of drafting one row at a time, in fewer forwards."""
    plain, looked = make(draft), make(draft, lookup_rows=rows)
    got = {}
    for proposer in (plain, looked):
        proposer.start("s", looping, 64)
        got[proposer] = one(proposer, job("s", 12, features=True))
    assert got[looked].token_ids == got[plain].token_ids == reference_greedy(draft, looping, 12)
    assert looked.looked_up_kept > 0
    mine, theirs = got[looked].steps, got[plain].steps
    assert len(mine) == len(theirs) == 12
    for a, b in zip(mine, theirs, strict=True):
        assert (a.position, a.token_id, a.rows) == (b.position, b.token_id, b.rows)
        assert a.token_prob == pytest.approx(b.token_prob, abs=1e-5)
        assert (a.top1_prob, a.top2_prob) == pytest.approx((b.top1_prob, b.top2_prob), abs=1e-5)
