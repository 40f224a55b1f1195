"""A batched draft in progress, row by row (``draft_model.DraftModelProposer``'s working state).

``SessionCache`` is what the proposer keeps of a session between drafts; ``Drafting`` one session's draft
within a run of forwards (its ``Mode``, fixed for the run, and what it has drafted so far); ``Pick`` the token
chosen from one row of logits. The helpers work over a step's rows: where each session's rows begin
(``first_rows``: its own token's, then one per looked-up guess), a row penalised as the verifier penalises p
(``penalise``), and the step features of every row that wants them (``step_features``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from services.drafter.control.base import DraftController, Spread, StepFeatures
from services.drafter.proposers.base import DraftJob
from services.drafter.proposers.draft_cache import KVCache, SessionCaches
from shared.penalties import apply_penalties
from shared.protocol import SparseQ
from shared.runner.topk import topk


@dataclass
class SessionCache:
    committed: list[int]
    caches: SessionCaches  # the main KV cache (None: no room) and the spares for branch lookaheads
    disabled: str = ""  # why this session cannot be drafted for; empty: it can
    drafting: int = 0  # its drafts in a run now (a stepped run lets a close come between forwards)
    closed: bool = False  # closed: its caches go back once no run drafts for it


class Mode(NamedTuple):
    """How one session drafts, fixed for a ``propose``."""

    sampled: bool  # drafted from the session's stream, with q
    raced: bool  # the winner of the request's keyed race at each position (shared.race)
    enders: frozenset[int]
    watch: DraftController | None
    features: bool  # compute step features (for ``watch``, or for a later screening)
    spread: bool  # ... with entropy and logit std (``watch`` reads them)
    penalised: bool  # the request has penalties: apply them to each row before choosing


@dataclass
class Drafting:
    """One session's draft in progress within a batched ``propose``."""

    job: DraftJob
    state: SessionCache
    cache: KVCache  # the main cache, or a spare for a branch lookahead (``DraftJob.branch``)
    k: int
    mode: Mode
    feed: list[int]  # tokens the next forward feeds for this session
    context: list[int]  # the committed sequence the draft continues
    limit: int  # with looked-up rows, at most this many tokens (k, and the job's ``spare``)
    guesses: list[int] = field(init=False, default_factory=list)  # looked-up tokens fed after ``feed``
    by_table: bool = field(init=False, default=False)  # this step's guess is the next-token table's
    tokens: list[int] = field(init=False, default_factory=list)
    runner_up: list[int] = field(init=False, default_factory=list)  # a greedy draft's second choice per token
    qs: list[SparseQ] = field(init=False, default_factory=list)
    steps: list[StepFeatures] = field(init=False, default_factory=list)
    done: bool = field(init=False, default=False)
    final: bool = field(init=False, default=False)  # stopped on its own, not by reaching k


class Pick(NamedTuple):
    """The token chosen for one row, its q (a sampled draft's) and the row it was chosen from."""

    token: int
    runner_up: int  # a greedy row's second choice; -1 for a sampled one
    q: SparseQ | None
    logits: torch.Tensor  # penalised when the request has penalties


def first_rows(live: Sequence[Drafting]) -> list[int]:
    """Each session's first logits row in a step: one row for its own token, then one per guess."""
    rows, at = [], 0
    for d in live:
        rows.append(at)
        at += 1 + len(d.guesses)
    return rows


def penalise(d: Drafting, logits: torch.Tensor) -> torch.Tensor:
    """One row penalised as the verifier penalises p at the same position: the prompt is the
    context's first ``prompt_len`` tokens; the rest, and this round's drafts so far, are generated."""
    n = d.job.session.prompt_len
    row = apply_penalties(logits.unsqueeze(0), d.job.params, d.context[:n], [*d.context[n:], *d.tokens])
    return row[0]


def step_features(live: Sequence[Drafting], picks: Sequence[Pick], logits: torch.Tensor,
                  top: torch.Tensor, sessions: int | None = None) -> list[StepFeatures | None]:
    """The step features of every row that wants them, in a few ops over all those rows at once:
    per row, ops over a vocabulary-wide row cost more in dispatch than in arithmetic. The
    probabilities come from log-sum-exp and the top two logits (``top``: the step's, of ``logits``,
    unless a row is penalised); the spread (entropy, logit std) only for the rows whose controller
    reads it. This runs on every draft step of a batch: for 12 rows of 4,096 logits it took 185 µs
    a step on this CPU, against 334 µs with a top-2 of its own over a stack of the rows (2026-11-27),
    which made AdaSpec's rounds draft slower than fixed k's. ``sessions``: those of the forward the features
    name (default ``live``'s)."""
    want = [i for i, d in enumerate(live) if d.mode.features]
    out: list[StepFeatures | None] = [None] * len(live)
    if not want:
        return out
    if any(live[i].mode.penalised for i in want):  # the rows picks chose from are not all the step's
        rows = torch.stack([picks[i].logits for i in want]).float()
        top = topk(rows, min(2, rows.shape[-1])).values
    elif len(want) < len(live):
        index = torch.tensor(want, device=logits.device)
        rows, top = logits.index_select(0, index).float(), top.index_select(0, index).float()
    else:
        rows, top = logits.float(), top.float()
    tokens = torch.tensor([picks[i].token for i in want], device=rows.device)
    lse = rows.logsumexp(-1, keepdim=True)
    chosen = rows.gather(-1, tokens[:, None])
    probs = torch.cat([chosen, top], -1).sub_(lse).exp_().tolist()
    entropy, logit_std = [math.nan] * len(want), [math.nan] * len(want)
    if spread := [n for n, i in enumerate(want) if live[i].mode.spread]:
        some = rows[spread]
        for n, e, sd in zip(spread, torch.special.entr((some - lse[spread]).exp_()).sum(-1).tolist(),
                            some.std(-1).tolist(), strict=True):
            entropy[n], logit_std[n] = e, sd
    for n, i in enumerate(want):
        d, p = live[i], probs[n]
        out[i] = StepFeatures(position=len(d.tokens), budget=d.k, token_id=picks[i].token, token_prob=p[0],
                              top1_prob=p[1], top2_prob=p[2] if len(p) > 2 else 0.0,
                              spread=Spread(entropy[n], logit_std[n]), rows=len(live) if sessions is None else sessions)
    return out
