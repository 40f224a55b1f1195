"""Race sampling (shared.race): the keyed variates, the winners, and the verifier's and the drafter's
use of them. Its law over 40,000 seeds is in tests/stat/test_seed_streams.py."""

from __future__ import annotations

import pytest
import torch

from services.verifier.judge import judge
from services.verifier.requests import Request
from shared.protocol import SamplingParams
from shared.race import BLOCK, keyed_exponentials, label, race_key, top_two, winners
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


def test_the_variates_depend_on_key_and_position() -> None:
    e = keyed_exponentials(label(11, 40), 4096)
    assert torch.equal(e, keyed_exponentials(label(11, 40), 4096))
    assert torch.equal(e[:1000], keyed_exponentials(label(11, 40), 1000))
    assert not torch.equal(e, keyed_exponentials(label(11, 41), 4096))
    assert not torch.equal(e, keyed_exponentials(label(12, 40), 4096))
    assert bool((e > 0).all()) and e.dtype == torch.float64


def test_a_smaller_vocabulary_races_over_the_same_blocks_and_variates() -> None:
    """A draft model's unpadded vocabulary is zero-padded to whole blocks: the same race as a
    padded one whose extra entries are 0."""
    p = torch.softmax(torch.randn(3 * BLOCK + 17, generator=torch.Generator().manual_seed(1)), -1)
    padded = torch.cat([p, torch.zeros(2 * BLOCK)])
    for n in range(50):
        assert winners(p.unsqueeze(0), 5, [n]) == winners(padded.unsqueeze(0), 5, [n])
        assert top_two(p, 5, n) == top_two(padded, 5, n)


def test_the_race_samples_its_distribution_and_never_an_excluded_token() -> None:
    p = torch.tensor([[0.1, 0.6, 0.0, 0.3]])
    won = [winners(p, key, [5])[0] for key in range(6000)]
    counts = torch.bincount(torch.tensor(won), minlength=4) / 6000
    assert counts[2] == 0 and torch.allclose(counts, p[0], atol=0.03)  # sigma <= 0.0064: a 4.7-sigma band


@pytest.mark.parametrize("vocab", [V, 5 * BLOCK + 3])
def test_top_two_is_the_winner_then_the_winner_without_it(vocab: int) -> None:
    """The runner-up is the token that wins the same race (the same variates) when the winner is
    left out: in its block, or in the block that then wins."""
    p = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
    for n in range(200):
        first, second = top_two(p, 3, n)
        assert first == winners(p.unsqueeze(0), 3, [n])[0] and second != first
        assert second == winners(p.index_fill(0, torch.tensor([first]), 0.0).unsqueeze(0), 3, [n])[0]


def test_the_two_level_race_samples_a_distribution_across_blocks() -> None:
    """Mass in three blocks, one of them with two tokens: each token wins as often as its weight."""
    p = torch.zeros(4 * BLOCK)
    tokens = [3, BLOCK + 7, BLOCK + 200, 3 * BLOCK + 1]
    p[tokens] = torch.tensor([0.2, 0.3, 0.1, 0.4])
    won = torch.tensor(winners(p.expand(8000, -1), 9, range(8000)))
    counts = torch.stack([(won == t).sum() for t in tokens]) / 8000
    assert int(sum((won == t).sum() for t in tokens)) == 8000  # never a token of weight 0
    assert torch.allclose(counts, p[tokens], atol=0.025)  # sigma <= 0.0055: a 4.5-sigma band


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
