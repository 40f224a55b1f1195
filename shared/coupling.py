"""A coupled bonus token: the verifier's own token after a fully accepted draft, drawn so that a
drafter can guess it at temperature > 0 (pipelined drafting for sampled requests).

The verifier draws that token by the *exponential race*: with E_x independent Exp(1) variates,
one per vocabulary entry, the winner ``argmax_x p(x) / E_x`` is an exact sample of p (it is the
Gumbel-max trick: -log E_x are Gumbel variates), run in two levels as ``shared.race`` runs it (a
race over blocks of tokens, then within the winning block). The E_x come from generators seeded by
(the request's bonus key, the round), and the verifier gives the key to the session's drafter.
The drafter, having sent a draft, guesses the verifier's token the same way from its own
distribution q at the bonus position: ``argmax_x q(x) / E_x``. When p and q are
close the two races usually have the same winner; with Σ min(p, q) = s they agree with
probability at least s / (2 - s), i.e. 0.67 at s = 0.8. The drafter's lookahead continues from
its guess, and is the next round's draft when the guess came true.

Why the output is still exactly the target's: each round is verified once, so the verifier uses
each round's variates at most once, and they are independent of everything that led to that
round: the acceptance uniforms and residual draws come from the request's own verification
stream, and the drafts from the drafter's stream. The drafter reads a round's variates only
after sending that round's draft, to choose which continuation to draft ahead; a wrong guess is
dropped, and a right one only decides which drafts come next, after the bonus token. Later rounds
have variates of their own. So the bonus token is an exact sample of p given the past, as if
drawn by inverting p's CDF.

A round uses the race only when its Draft asks for it (``Draft.guess_bonus``) and the verifier
verifies the whole draft (a trimmed draft's bonus is not where the drafter guessed): a race's
variates cost more than the single uniform of an inverted CDF. Only
unseeded sampled requests race: a seeded request's stream must not depend on whether a
lookahead ran.
"""

from __future__ import annotations

import secrets

import torch

from shared.race import finishers


def new_bonus_key() -> int:
    """A request's bonus key: fresh entropy (only unseeded requests race)."""
    return secrets.randbits(63)


def race_winner(probs: torch.Tensor, key: int, round_: int) -> int:
    """The winner of round ``round_``'s race (keyed by ``key``) over ``probs [V]``, in two levels as
    ``shared.race`` races: an exact sample of ``probs`` (weights need not sum to 1)."""
    return finishers(probs, f"{key}:{round_}")[0]
