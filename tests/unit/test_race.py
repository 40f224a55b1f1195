"""Race sampling (shared.race): the keyed variates, the winners, and the verifier's and the drafter's
use of them. Its law over 40,000 seeds is in tests/stat/test_seed_streams.py."""

from __future__ import annotations

import pytest
import torch

from services.verifier.judge import judge
from services.verifier.requests import Request
from shared.protocol import SamplingParams
from shared.race import noise, race_key, top_two, winners
from shared.sampling import probs_from_logits
from tests.verifier_requests import make_request

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
V = 40


def raced(params: SamplingParams = SAMPLED, prompt: tuple[int, ...] = (1, 2, 3)) -> Request:
    return make_request("r", list(prompt), params, True, 64, frozenset(), race=True)


def test_a_seeded_request_has_a_reproducible_key_and_an_unseeded_one_a_fresh_key() -> None:
    assert race_key(7) == race_key(7) != race_key(8)
    assert len({race_key(None) for _ in range(50)}) == 50
    assert all(0 <= k < 2**63 for k in (race_key(7), race_key(None)))


def test_only_sampled_requests_under_race_sampling_are_raced() -> None:
    assert raced().sampler.race_key is not None and raced().deterministic
    assert raced(SamplingParams(temperature=0.0)).sampler.race_key is None  # greedy: argmax
    stream = make_request("r", [1], SAMPLED, True, 64, frozenset())
    assert stream.sampler.race_key is None and not stream.deterministic


def test_the_variates_depend_on_key_and_position_and_agree_across_vocabulary_sizes() -> None:
    """A draft model with a smaller (unpadded) vocabulary races over a prefix of the same variates."""
    e = noise(11, 40, 4096)
    assert torch.equal(e, noise(11, 40, 4096)) and torch.equal(e[:1000], noise(11, 40, 1000))
    assert not torch.equal(e, noise(11, 41, 4096)) and not torch.equal(e, noise(12, 40, 4096))
    assert bool((e > 0).all()) and e.dtype == torch.float64


def test_the_race_samples_its_distribution_and_never_an_excluded_token() -> None:
    p = torch.tensor([[0.1, 0.6, 0.0, 0.3]])
    won = [winners(p, key, [5])[0] for key in range(6000)]
    counts = torch.bincount(torch.tensor(won), minlength=4) / 6000
    assert counts[2] == 0 and torch.allclose(counts, p[0], atol=0.03)  # sigma <= 0.0064: a 4.7-sigma band


def test_top_two_is_the_winner_then_the_next_best_score() -> None:
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(0)), -1)
    first, second = top_two(p, 3, 9)
    assert first == winners(p.unsqueeze(0), 3, [9])[0] and second != first


@pytest.mark.parametrize("hits", [0, 1, 2, 3])
def test_judge_accepts_drafts_while_they_are_the_winners(hits: int) -> None:
    """A raced session is judged as a greedy one against each row's winner, the rows at positions
    len(committed), len(committed) + 1, ..."""
    torch.manual_seed(hits)
    logits = torch.randn(4, V) * 3
    req = raced()
    assert req.sampler.race_key is not None
    won = winners(probs_from_logits(logits, SAMPLED), req.sampler.race_key, range(3, 7))
    drafts = [*won[:hits], *[(w + 1) % V for w in won[hits:3]]]
    verdict = judge([(req, drafts)], logits)[0]
    assert verdict.accepted == hits and verdict.tokens == won[: hits + 1]
    assert verdict.accept_prob == hits  # the drafts equal to their rows' winners


def test_a_raced_token_does_not_depend_on_the_draft_or_the_round() -> None:
    """The token at a position is its race's winner whoever drafted what: one long round, or one
    token per round with any drafts, commit the same text."""
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 2
    req = raced()
    assert req.sampler.race_key is not None
    whole = judge([(req, [])], logits[:1])[0].tokens
    for junk in range(5):
        assert judge([(req, [junk])], logits[:2])[0].tokens[0] == whole[0]
