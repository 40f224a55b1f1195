"""The proposer interface: whatever makes draft tokens (a draft LM now, n-gram lookup later).

A proposer holds per-session state keyed by the request id. The serving loop calls it only
from its single compute worker thread, so implementations need no locking; calls for one
session come strictly in order: ``start``, then rounds of ``propose`` / ``commit``, then
``close``.

``propose`` takes a batch of jobs, one per session, and drafts them together. A stepping proposer
(:class:`SteppingProposer`, the draft model's) also drafts a batch one forward at a time
(``begin``, ``step``, ``join``): the batcher then lets the sessions whose verdicts came meanwhile
join the batch at its next forward, and hands each session its draft as soon as it is done.
``commit`` hands over the tokens the verifier committed after a round (the accepted drafts,
then its own token); the proposer rolls back whatever it had speculated past them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from services.drafter.control.base import DraftController, StepFeatures
from shared.protocol import SamplingParams, SparseQ


class ProposerError(RuntimeError):
    """A proposer could not serve a call (unknown session, ...). The session drafts nothing more."""


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round.

    ``q`` is None for ids-only drafts (the verifier treats q as one-hot on each token, which is
    exact), or one SparseQ per token: the exact distribution that token was sampled from
    (``shared.draft_q``). A token that guesses the verifier's bonus token (``DraftJob.guess``) has
    none: it is never sent as a draft.
    ``steps`` are the controller features of the kept tokens, when the controller reads them.
    """

    token_ids: list[int]
    q: list[SparseQ] | None = None
    steps: list[StepFeatures] = field(default_factory=list)
    final: bool = False  # drafting ended on its own (an end token, or the controller stopped it)
    #: a greedy (or raced) draft's second choice at each position (the draft model's runner-up), when
    #: the proposer ranks its tokens: the verifier's likeliest correction if it rejects that draft
    runner_up: list[int] = field(default_factory=list)


EMPTY_PROPOSAL = Proposal(token_ids=[])


@dataclass(frozen=True)
class JobSession:
    """The session a draft job drafts for: what stays the same from one of its rounds to the next."""

    session_id: str
    params: SamplingParams
    rng: torch.Generator  # the session's drafting stream (independent of the verifier's)
    #: how many of the session's first committed tokens are its prompt: penalties (frequency,
    #: presence) count only the tokens after them as generated, as the verifier does
    prompt_len: int = 0
    #: the request's race key (shared.race): a sampled request's tokens are keyed races, so each
    #: draft token is the same race over the draft model's distribution (ids only); None: not raced
    race_key: int | None = None


@dataclass(frozen=True)
class Continuation:
    """Where a draft continues: after the session's committed tokens (a round's draft), or, for a
    lookahead, after the first ``base`` of them plus ``assume`` (the Draft in flight, assumed
    accepted, or a branch's other outcome)."""

    assume: tuple[int, ...] = ()
    base: int = -1  # < 0: after every committed token
    #: which of the session's draft caches to draft in: 0 the main one; n > 0 a spare, for a
    #: lookahead of another outcome than "all accepted" (``lookahead.py``). A proposer without
    #: caches ignores it.
    branch: int = 0
    #: a lookahead at temperature > 0: its first token guesses the verifier's coupled bonus token,
    #: the winner of the race keyed by (key, round) over the request's full distribution
    #: (shared.coupling); the proposer draws the race's variates for its own vocabulary
    guess: tuple[int, int] | None = None


@dataclass(frozen=True)
class DraftJob:
    """One session's drafting request for one round (or one lookahead branch)."""

    session: JobSession
    k: int  # draft at most this many tokens
    controller: DraftController | None = None
    after: Continuation = field(default_factory=Continuation)
    #: compute step features without a controller (a lookahead its controller screens later)
    features: bool = False
    #: ... with their entropy and logit spread (that later controller reads them: ``wants_spread``)
    spread: bool = False
    #: tokens beyond ``k`` the proposer may add when they cost no forward of their own (a draft
    #: model's looked-up rows): a lookahead drafted one token a batch takes what comes free
    spare: int = 0

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def params(self) -> SamplingParams:
        return self.session.params


class Proposer(Protocol):
    name: str
    #: it honours ``Continuation.guess`` (and so can draft ahead of a sampled request's verdict)
    guesses_bonus: bool

    def start(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Begin a session whose committed sequence is ``prompt_ids``; it will grow by at most
        ``max_new_tokens`` committed tokens (plus one round's drafts)."""

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        """For each job, up to ``k`` tokens continuing its session's committed sequence (the
        controller may stop early), in job order. Sessions are drafted together: a draft model
        runs one forward per draft position for the whole batch (StarSD §3). A job whose session
        was closed meanwhile gets an empty proposal."""

    def commit(self, session_id: str, committed_new_tokens: list[int], accepted: int) -> None:
        """The verifier committed these tokens; the first ``accepted`` were our drafts."""

    def close(self, session_id: str) -> None:
        """Forget the session (idempotent)."""


@dataclass
class DraftRun:
    """A batch a :class:`SteppingProposer` drafts one forward at a time: jobs join between forwards,
    and each job's proposal is ready as soon as its session leaves the batch. The run keeps only its
    live jobs and the proposals not yet taken, however long it lasts."""

    live: list[Any] = field(default_factory=list)  # the proposer's state of each job still drafting
    finished: list[tuple[DraftJob, Proposal]] = field(default_factory=list)  # since the last take_finished

    def take_finished(self) -> list[tuple[DraftJob, Proposal]]:
        """The jobs finished since the last call, with their proposals."""
        done, self.finished = self.finished, []
        return done

    @property
    def done(self) -> bool:
        return not self.live


@runtime_checkable
class SteppingProposer(Protocol):
    """A proposer whose batches can be drafted one forward at a time (on the compute worker, like
    every proposer call; ``start``, ``commit`` and ``close`` of other sessions may come between the
    steps, and a session closed mid-batch leaves it at the next step). A run that will not be stepped
    to its end (an error, the verifier link lost) must be abandoned, or its sessions' caches stay taken."""

    def begin(self, jobs: Sequence[DraftJob]) -> DraftRun:
        """A run of ``jobs``; no forward yet."""

    def join(self, run: DraftRun, jobs: Sequence[DraftJob]) -> None:
        """``jobs`` join ``run`` at its next forward."""

    def step(self, run: DraftRun) -> int:
        """One forward for every job still drafting in ``run``; how many sessions it drafted for."""

    def abandon(self, run: DraftRun) -> None:
        """Drop the run's live jobs without proposals, and give back the caches of the sessions closed
        meanwhile."""
