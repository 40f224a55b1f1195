"""The coupled bonus token (shared.coupling): the race's variates, its winner, and the verifier's and
the drafter's use of it. Its law over many seeds is in tests/stat/test_coupled_bonus.py."""

from __future__ import annotations

import pytest
import torch

from services.verifier.judge import judge, races
from services.verifier.requests import Request
from shared.coupling import new_bonus_key, race_winner
from shared.draft_q import guess_token
from shared.protocol import SamplingParams
from shared.sampling import make_generator, probs_from_logits, sample
from tests.verifier_requests import make_request

SAMPLED = SamplingParams(temperature=1.0, max_tokens=8)
V = 50


def _request(guess: bool, key: int = 7) -> Request:
    req = make_request("r", [1, 2, 3], SAMPLED, True, 64, frozenset())
    req.round.draft.guess_bonus, req.sampler.bonus_key, req.sampler.gen = guess, key, make_generator(0, "verify")
    return req


def test_a_bonus_key_is_fresh_entropy() -> None:
    keys = {new_bonus_key() for _ in range(100)}
    assert len(keys) == 100 and all(0 <= key < 2**63 for key in keys)


def test_the_race_depends_on_key_and_round_and_agrees_across_vocabulary_sizes() -> None:
    """A draft model with a smaller (unpadded) vocabulary races over the same variates."""
    p = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(2)), -1)
    padded = torch.cat([p, torch.zeros(3096)])
    won = [race_winner(p, 11, n) for n in range(60)]
    assert won == [race_winner(padded, 11, n) for n in range(60)]
    assert won != [race_winner(p, 12, n) for n in range(60)] and won != [race_winner(p, 11, n + 1) for n in range(60)]


@pytest.mark.parametrize("probs", [[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [1e-30, 0.0, 1.0]])
def test_the_race_never_picks_a_token_of_probability_zero(probs: list[float]) -> None:
    p = torch.tensor(probs)
    assert all(p[race_winner(p, 3, pos)] > 0 for pos in range(200))


def test_the_race_samples_its_distribution() -> None:
    p = torch.tensor([0.1, 0.6, 0.3])
    counts = torch.bincount(torch.tensor([race_winner(p, 1, pos) for pos in range(6000)]), minlength=3)
    assert torch.allclose(counts / 6000, p, atol=0.03)  # sigma <= 0.0064: a 4.7-sigma band


def test_when_the_draft_model_is_the_target_the_guess_is_always_the_verifiers_token() -> None:
    """No drafts: the verifier's own token is the bonus; the drafter guesses it from the same logits."""
    torch.manual_seed(0)
    for key in range(40):
        logits = torch.randn(1, V) * 2
        req = _request(guess=True, key=key)
        req.round.number = key % 5
        token = judge([(req, [])], logits)[0].tokens[0]
        guess = guess_token(logits[0], SAMPLED, (key, req.round.number))
        assert guess == token


def test_without_a_guess_the_verifier_draws_from_its_own_stream_as_before() -> None:
    logits = torch.randn(1, V)
    token = judge([(_request(guess=False), [])], logits)[0].tokens[0]
    assert token == sample(probs_from_logits(logits[0], SAMPLED), make_generator(0, "verify"))


def test_a_rejection_still_gives_a_residual_token_when_guessing() -> None:
    """The race serves only the token after a fully accepted draft; a rejected draft's position
    gets the residual's token."""
    logits = torch.full((2, V), -30.0)
    logits[:, 4] = 0.0  # the target is sure of token 4; the draft 9 is rejected with certainty
    req = _request(guess=True)
    assert judge([(req, [9])], logits)[0].tokens == [4]


@pytest.mark.parametrize(("guess", "sent", "verified", "accepted", "race"), [
    (True, [5, 6], [5, 6], 2, True),  # asked, whole draft verified and accepted
    (True, [5, 6], [5, 6], 1, False),  # a rejection: the residual's token comes from the stream
    (True, [5, 6, 7], [5, 6], 2, False),  # trimmed: the bonus is not where the drafter guessed
    (False, [5, 6], [5, 6], 2, False),  # not asked
    (True, [], [], 0, True),  # an empty draft: the round's own token is the bonus
], ids=["accepted", "rejected", "trimmed", "not-asked", "empty"])
def test_when_a_round_races(guess: bool, sent: list[int], verified: list[int], accepted: int, race: bool) -> None:
    req = _request(guess=guess)
    req.round.draft.ids = sent
    assert races(req, verified, accepted) is race
