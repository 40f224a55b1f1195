"""Synthetic draft tokens: whether the target accepts each one, and what the draft model "felt" about it.

Assumptions (the simulator's model of a draft/target pair):

* Each drafted token has an acceptance probability ``a`` (the Σ min(1, p/q) term of GoodSpeed
  eq. 3), drawn independently per token from Beta(κ·α, κ·(1 − α)) where α is the drafter's mean
  acceptance rate and κ (``alpha_concentration``) how concentrated the draws are: small κ gives
  many near-sure and near-hopeless tokens (confidence is informative), large κ makes every token
  close to α. The mean is α, so a round of k drafts commits (1 − α^(k+1))/(1 − α) tokens on
  average, the expectation GoodSpeed and SmartSpec plan with. α = 1 and α = 0 are exact
  (always and never accepted).
* The token is accepted with probability ``a``; the verifier accepts the longest accepted
  prefix and adds one token of its own (``accepted_prefix``).
* The draft model is calibrated: its confidence in the token it drafts is ``a`` itself. The
  per-token features the real controllers read come from a small synthetic distribution with
  that top-1 probability: top-2 gets half of the remaining mass (at most the top-1), the rest is
  spread evenly over ``TAIL`` tokens. Entropy and logit spread are those of this distribution, so
  they fall (nearly) monotonically as ``a`` rises: confidence carries information as in reality,
  and a perfect one (a real model is noisier).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from services.drafter.control.base import Spread, StepFeatures

#: tokens over which the synthetic distribution spreads the mass left after the top two
TAIL = 64
_EPS = 1e-6


def acceptance_prob(rng: random.Random, alpha: float, concentration: float) -> float:
    """One token's acceptance probability a ~ Beta(κα, κ(1 − α)); exactly α at the ends."""
    if alpha >= 1.0:
        return 1.0
    if alpha <= 0.0:
        return 0.0
    return rng.betavariate(concentration * alpha, concentration * (1.0 - alpha))


def features(a: float, position: int, budget: int, rows: int = 1) -> StepFeatures:
    """The step features of a drafted token whose acceptance probability (and draft confidence) is
    ``a``, drafted in a step for ``rows`` sessions."""
    c = min(1.0 - _EPS, max(_EPS, a))
    top2 = min(c, (1.0 - c) / 2.0)
    tail = (1.0 - c - top2) / TAIL
    logs = (math.log(c), math.log(top2), math.log(tail))
    entropy = -(c * logs[0] + top2 * logs[1] + TAIL * tail * logs[2])
    n = TAIL + 2
    mean = (logs[0] + logs[1] + TAIL * logs[2]) / n
    var = ((logs[0] - mean) ** 2 + (logs[1] - mean) ** 2 + TAIL * (logs[2] - mean) ** 2) / n
    return StepFeatures(position=position, budget=budget, token_id=0, token_prob=c, top1_prob=c, top2_prob=top2,
                        spread=Spread(entropy, math.sqrt(var)), rows=rows)


def accepted_prefix(accepted: Sequence[bool]) -> int:
    """How many leading drafts the target accepts (verification stops at the first rejection)."""
    n = 0
    for ok in accepted:
        if not ok:
            break
        n += 1
    return n

