"""Pipelined sampled speculation is unbiased: the verifier's coupled bonus token (shared.coupling).

When a sampled request pipelines, the verifier draws its token after a fully accepted draft by a
race keyed by (the request's bonus key, the round), and the drafter runs the same race over its
own distribution to guess that token and draft on from it. The drafter therefore knows the race's
variates; a guess that failed is dropped, and its lookahead drew from the drafting stream.

This drives the real in-process code over 20,000 seeds (40,000 with ``make test-stat-full``;
shared among the cores by tests.stat.seeds): the drafter's ``draft_token`` and ``guess_token``,
and the verifier's ``judge``, through rounds of 2 then 1 drafts, with the lookahead's
continuation becoming the next draft when its guess came true, exactly as the session runner
does. The target and draft are small first-order Markov chains with different laws. Each of the
first three generated tokens must follow the target's law: with n = 20,000 a token of probability
0.2 has sigma 0.28 percentage points, so a 1-point shift is 3.5 sigma (5 at 40,000). A control
in which the verifier trusts the drafter's guess must be caught.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from services.verifier.judge import judge
from shared.draft_q import Nucleus, check, draft_token, guess_token
from shared.protocol import SamplingParams, SparseQ
from tests.stat.seeds import FULL, over_seeds
from tests.verifier_requests import make_request

SEEDS = 40_000 if FULL else 20_000
#: the control's shift is large: 5.4 sigma at 10,000 seeds (measured), about 7.7 at 20,000
CONTROL_SEEDS = 20_000 if FULL else 10_000
PROMPT = [0]
PARAMS = SamplingParams(temperature=1.0, max_tokens=8)
#: P[a] is the target's law of the token after token a; Q[a] the draft model's
P = torch.tensor([[0.50, 0.30, 0.20], [0.20, 0.45, 0.35], [0.30, 0.20, 0.50]], dtype=torch.float64)
Q = torch.tensor([[0.35, 0.40, 0.25], [0.30, 0.30, 0.40], [0.45, 0.15, 0.40]], dtype=torch.float64)
V = 3
EXACT = Nucleus(1.0, V)


def _rows(last: int, drafts: list[int]) -> torch.Tensor:
    """The target's logits for a round: after the last committed token, then after each draft."""
    return torch.log(P[[last, *drafts]]).float()


def _drafts(drafter: torch.Generator, last: int, k: int) -> tuple[list[int], list[SparseQ]]:
    tokens, qs = [], []
    for _ in range(k):
        token, q = draft_token(torch.log(Q[last]).float(), PARAMS, drafter, EXACT)
        tokens.append(token)
        qs.append(q)
        last = token
    return tokens, qs


def _generate(seed: int, trust_guess: bool = False) -> list[int]:
    """The first three tokens of one request: rounds of 2 then 1 drafts, each followed by a
    lookahead (a guess of the bonus token, then one drafted token) used when the guess came true."""
    drafter = torch.Generator().manual_seed(2 * seed)
    req = make_request(f"r{seed}", PROMPT, PARAMS, True, 64, frozenset())
    req.sampler.gen, req.sampler.bonus_key = torch.Generator().manual_seed(2 * seed + 1), seed
    ready: tuple[list[int], list[SparseQ]] | None = None
    rounds = 0
    while req.generated < 3:
        k = 2 if rounds == 0 else 1
        drafts, qs = ready if ready is not None else _drafts(drafter, req.committed[-1], k)
        req.round.number, req.round.draft.ids = rounds, drafts
        guess = guess_token(torch.log(Q[drafts[-1]]).float(), PARAMS, (req.sampler.bonus_key, req.round.number))
        ahead = _drafts(drafter, guess, 1)  # the lookahead drafts on while the round is verified
        req.round.draft.q, req.round.draft.guess_bonus = [check(q, t, V) for q, t in zip(qs, drafts, strict=True)], True
        verdict = judge([(req, drafts)], _rows(req.committed[-1], drafts))[0]
        tokens = verdict.tokens
        if trust_guess and verdict.accepted == k:  # the control: a verifier that takes the guess
            tokens = [*tokens[:-1], guess]
        req.committed.extend(tokens)
        ready = ahead if verdict.accepted == k and tokens[-1] == guess else None
        rounds += 1
    return req.committed[len(PROMPT):][:3]


def _counts(trust_guess: bool, seeds: range) -> torch.Tensor:
    counts = torch.zeros(3, V, dtype=torch.float64)
    for seed in seeds:
        for position, token in enumerate(_generate(seed, trust_guess)):
            counts[position, token] += 1
    return counts


def _worst_sigma(trust_guess: bool, seeds: int = SEEDS) -> tuple[float, torch.Tensor]:
    freq = over_seeds(partial(_counts, trust_guess), seeds) / seeds
    law = torch.zeros(3, V, dtype=torch.float64)
    law[0] = P[PROMPT[-1]]
    law[1] = law[0] @ P
    law[2] = law[1] @ P
    sigma = (law * (1 - law) / seeds).sqrt()
    return float(((freq - law).abs() / sigma).max()), freq


@pytest.mark.stat
def test_pipelined_sampled_rounds_give_the_targets_law() -> None:
    worst, freq = _worst_sigma(trust_guess=False)
    assert worst < 3.5, freq.tolist()


@pytest.mark.stat
def test_the_check_catches_a_verifier_that_trusts_the_guess() -> None:
    """Power control: the drafter's guess follows q, not p, and the same check must see it."""
    worst, freq = _worst_sigma(trust_guess=True, seeds=CONTROL_SEEDS)
    assert worst > 3.5, freq.tolist()
    assert math.isfinite(worst)
