"""Pipelined drafting: draft the next round while this one is being verified.

After a session sends its Draft, it asks the batcher for a *lookahead*: tokens that continue the
sent draft as if the verifier accepted all of it (SpecEdge's proactive edge drafting). The first
lookahead token guesses the verifier's own token after a fully accepted draft; the rest continue
from that guess. When the Verdict accepts every draft and its last token equals the guess, the
rest of the lookahead is the next round's draft, ready at once, its keys and values already in
the draft cache. (A continuous verifier such as vLLM may commit several tokens after the draft:
then the lookahead must have guessed them all.) Otherwise it is dropped (the proposer's
rollback discards it from the cache).

A greedy draft is also rejected often, and then the verifier's own token is often the draft
model's runner-up at that position (``Proposal.runner_up``). On the demo pair at k = 4 (an
offline count over the benchmark prompts: 580 rounds), 345 rounds rejected a draft, and in 180
of them the verifier's token was the runner-up. So a
greedy session alone on its drafter also drafts *alternative* lookaheads, up to
``--lookahead-branches`` of them: for draft j, "drafts before j accepted, the runner-up committed
instead", for the positions where that came true most often so far (``BranchOdds``). Each drafts
in a spare KV cache of the session (``proposers/draft_cache.py``) and all of them share the draft
model's forwards; the verdict keeps the one whose outcome came true, if any, and the proposer
makes its cache the session's. Each alternative adds a row to every lookahead forward, so only a
few pay: on the demo pair one or two beat four (bench/RESULTS.md, greedy serving); and a position
is only branched while its alternative comes true often enough to pay for its row
(``BRANCH_MIN_ODDS``): a draft that agrees with the target almost always gets none.

The draft model would sit idle during verification anyway, so a dropped lookahead costs only
edge compute, and a batched lookahead rides along with other sessions' drafts.

**Conditional drafts.** A lookahead need not wait for the verdict it assumes: as soon as a branch
is drafted, it goes to a verifier that takes them (``Welcome.conditional_drafts``) as the next
round's Draft with ``after``, the tokens its outcome commits. The verifier keeps it and, when the
round ends committing exactly those tokens, verifies it at once, without a round trip to the
edge; any other outcome drops it, and the drafter drafts that round afresh as before. The verdict
tells the drafter which happened: the verifier holds the branch's draft exactly when the verdict's
tokens equal the branch's ``after`` and it grants a budget (``Lookahead.presented``).

A lookahead is drafted without the session's controller (it is not a round), but with the
step features the controller reads; the round that takes it lets the controller screen it token
by token, so a policy stops a ready draft where it would have stopped a fresh one. A conditional
Draft goes out before that round begins, while the round in flight still owns the controller's
round state: it is cut where the controller would stop it now (``DraftController.keeps``, which
changes no state; with the estimates of one verdict earlier), and not sent if the controller
would draft nothing. The round that finds it presented shows the controller its tokens all the
same, so that the controller learns from its verdict.

Deterministic requests pipeline: greedy ones (argmax drafts) and raced ones (under race
sampling, ``shared.race``: each draft token is the winner of the verifier's keyed race over the
draft model's distribution, and the lookahead's first token is simply the race at the bonus
position). They draw no randomness, so whether a lookahead ran or was used changes nothing, and
their runner-ups guess the verifier's correction after a rejection. Under stream sampling,
unseeded sampled requests pipeline too, when the verifier couples its bonus token
(``shared.coupling``): the first lookahead token is then the winner of the same race the verifier
runs for that one token, and the rest are sampled from the drafting stream with their q, as in
any round. (A seeded one does not: its stream would then depend on timing.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from services.drafter.batcher import DraftBatcher
from services.drafter.control.base import DraftController, StepFeatures, keep_until_stop
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import Continuation, DraftJob, Proposal
from shared.calibration import ewma
from shared.protocol import SparseQ, Verdict

#: ``BranchOdds``: a position's hit rate before it is observed, and the moving average's weight
ODDS_PRIOR = 0.15
ODDS_ALPHA = 0.05
#: the least hit rate a position's alternative is drafted ahead at. An alternative adds a row to each of
#: the lookahead's forwards and saves, when it comes true, a round's fresh draft and round trip: about a
#: tenth of a round is where it pays. The target's own 4-bit copy (0.97 agreement) stays below it at
#: every position, and at one request its drafter is the edge's bottleneck: bench profile, Q4_1 draft,
#: paired runs: 176.7 and 144.2 tokens/s without alternatives, 148.7 and 130.6 with one
BRANCH_MIN_ODDS = 0.1


#: sends a branch's draft as the next round's conditional Draft: (its ``after``, the draft) -> whether
#: that Draft asks the verifier to race its bonus token (``Draft.guess_bonus``)
Presend = Callable[[tuple[int, ...], Proposal], Awaitable[bool]]


@dataclass(eq=False)
class _Branch:
    """One lookahead: the outcome of the round in flight it assumes, and the task drafting after it."""

    accepted: int  # drafts of the round in flight it assumes accepted
    guessed: tuple[int, ...]  # the verifier's token it assumes after them; () when its first token guesses it
    asked: int  # tokens its job asked the proposer for
    prefix: tuple[int, ...]  # the round's tokens it assumes: the accepted drafts, then ``guessed``
    task: asyncio.Task[tuple[Proposal, float, float]] = field(init=False)
    presented: tuple[int, ...] | None = None  # ``after`` of the conditional Draft sent from it
    sent: int = 0  # that Draft's tokens: the branch's draft, cut where the session's controller would stop it
    guess_bonus: bool = False  # that Draft's guess_bonus

    def next_draft(self, proposal: Proposal) -> tuple[tuple[int, ...], Proposal] | None:
        """What the branch's outcome commits (the round's tokens: its prefix, then its first token
        when that guesses the verifier's) and the next round's draft after it; None when empty."""
        cut = 0 if self.guessed else 1
        if len(proposal.token_ids) <= cut:
            return None
        return (*self.prefix, *proposal.token_ids[:cut]), _rest(proposal, cut)


class Lookahead:
    """One session's lookaheads: those of the round in flight, and at most one ready draft."""

    def __init__(self) -> None:
        self._branches: list[_Branch] = []
        self._ready: Proposal | None = None
        self._open = False  # the round in flight's verdict is not settled yet: branches may pre-send
        self.asked = 0  # tokens asked of the ready draft's proposer past the verdict's: it holds that many or fewer
        #: the ready draft already is at the verifier, as the next round's Draft (a conditional one that came
        #: true), with this guess_bonus
        self.presented = False
        self.presented_guess = False
        self._sent = 0  # tokens of the presented draft the verifier holds, at most
        self._screen: DraftController | None = None  # the session's controller, for conditional Drafts

    def start(self, batcher: DraftBatcher, job: DraftJob, alternatives: Sequence[tuple[int, int]] = (),
              presend: Presend | None = None, screen: DraftController | None = None) -> None:
        """Draft ``job`` (its ``assume`` is the Draft just sent) while the verdict is awaited, and
        for each ``(j, token)`` of ``alternatives`` the outcome "draft j rejected, ``token``
        committed instead", in a spare draft cache (``DraftJob.branch``). With ``presend``, each
        branch is sent as a conditional Draft as soon as it is drafted, if the verdict has not come,
        cut where ``screen`` (the session's controller) would stop it, and not at all if at once."""
        self.cancel()
        self._open, self._screen = True, screen
        self._spawn(_Branch(len(job.after.assume), (), job.k, job.after.assume), batcher, job, presend)
        for n, (j, token) in enumerate(alternatives, start=1):  # k - 1: the correction is assumed, not drafted
            after = Continuation((*job.after.assume[:j], token), job.after.base, branch=n)
            alt = replace(job, k=job.k - 1, after=after)
            self._spawn(_Branch(j, (token,), alt.k, alt.after.assume), batcher, alt, presend)

    def _spawn(self, branch: _Branch, batcher: DraftBatcher, job: DraftJob, presend: Presend | None) -> None:
        branch.task = asyncio.create_task(self._draft(branch, batcher, job, presend),
                                          name=f"lookahead-{job.session_id}-{job.after.branch}")
        self._branches.append(branch)

    async def _draft(self, branch: _Branch, batcher: DraftBatcher, job: DraftJob,
                     presend: Presend | None) -> tuple[Proposal, float, float]:
        drafted = await _one_token_at_a_time(batcher, job)
        if presend is None or not self._open:  # no verifier to hold it, or its verdict is being settled
            return drafted
        nxt = branch.next_draft(drafted[0])
        if nxt is None:
            return drafted
        after, draft = nxt[0], _rest(nxt[1], 0, self._kept(nxt[1]))
        if draft.token_ids:  # decided and written in one turn of the loop, before settle
            branch.presented, branch.sent = after, len(draft.token_ids)
            branch.guess_bonus = await presend(after, draft)
        return drafted

    def _kept(self, draft: Proposal) -> int:
        """How much of a branch's draft goes out: what the session's controller would keep of it
        were its round to begin now (nothing when it reads features the draft lacks)."""
        n, screen = len(draft.token_ids), self._screen
        if screen is None or not screen.wants_features:
            return n
        return screen.keeps(_positioned(draft.steps, n), n) if len(draft.steps) >= n else 0

    def take(self, k: int, controller: DraftController | None = None) -> Proposal | None:
        """The next round's draft, if the last lookahead came true: at most ``k`` tokens, and
        screened by the session's controller as if it had watched them being drafted (not one
        the verifier already holds: ``presented``, which ``take`` clears, is the part that was sent, and
        the controller sees its tokens go by, as it would have seen them drafted, to learn from the verdict)."""
        ready, self._ready = self._ready, None
        presented, self.presented = self.presented, False
        if ready is None or k <= 0:
            return None
        n = min(k, len(ready.token_ids), self._sent if presented else k)
        if controller is None or not controller.wants_features or len(ready.steps) < n:
            return _rest(ready, 0, n)
        steps = _positioned(ready.steps, k)[:n]
        if presented:
            for step in steps:
                controller.on_step(step)  # recorded for its end_round; the verifier holds these tokens anyway
        else:
            n = keep_until_stop(controller.on_step, steps, n)
        return _rest(ready, 0, n)

    async def settle(self, verdict: Verdict, drafted: int, metrics: DrafterMetrics) -> None:
        """Keep the lookahead whose outcome the verdict made true; drop the others."""
        self._open = False
        branches, self._branches = self._branches, []
        if not branches:
            return
        accepted = min(verdict.accepted, drafted)
        after = list(verdict.token_ids[accepted:])  # the verifier's own tokens after the accepted drafts
        match = None if verdict.finished or not verdict.token_ids else \
            next((b for b in branches if b.accepted == accepted), None)
        try:
            for branch in branches:
                if branch is not match:
                    branch.task.cancel()  # first, so they take no more forwards while the match finishes
            for branch in branches:
                if branch is not match:
                    await _drop(branch.task)
            if match is None:
                metrics.lookahead.labels("dropped").inc()
                return
            try:
                proposal, _, _ = await match.task
            except Exception:  # the batcher logged it; the round simply drafts afresh
                return
        finally:  # cancelled meanwhile (the session ends): leave no lookahead running
            for branch in branches:
                branch.task.cancel()
        self._keep(match, proposal, after, metrics)
        # the verifier took the branch's conditional Draft exactly when this holds (services.verifier.core)
        self.presented = (self._ready is not None and match.presented == tuple(verdict.token_ids)
                          and verdict.draft_budget > 0)
        self.presented_guess, self._sent = match.guess_bonus, match.sent
        if self.presented:
            metrics.presented.inc()

    def _keep(self, branch: _Branch, proposal: Proposal, after: list[int], metrics: DrafterMetrics) -> None:
        """Make the rest of ``branch``'s lookahead ready if it guessed ``after``, the verifier's own
        tokens after the accepted drafts (one; a continuous verifier such as vLLM may commit several, or
        none after a fully accepted draft: then the whole all-accepted lookahead is the next draft)."""
        full = [*branch.guessed, *proposal.token_ids]
        if full[:len(after)] != after or len(full) <= len(after) or len(after) < len(branch.guessed):
            metrics.lookahead.labels("missed").inc()
            return
        cut = len(after) - len(branch.guessed)  # of the proposal's own tokens: at least one guessed token
        self._ready = _rest(proposal, cut)
        self.asked = branch.asked - cut
        metrics.lookahead.labels("used").inc()
        if branch.guessed:
            metrics.alternative_used.inc()

    def cancel(self) -> None:
        self._ready, self._open, self.presented = None, False, False
        for branch in self._branches:
            branch.task.cancel()
        self._branches = []


class BranchOdds:
    """How often the verifier's token after a rejection at draft position j was the draft model's
    runner-up there, per position (a moving average over this drafter's greedy rounds). Every
    round is observed, branched or not, so the estimate never depends on what was drafted ahead;
    ``pick`` drafts ahead only for the likeliest alternatives."""

    def __init__(self) -> None:
        self.rate: dict[int, float] = {}

    def observe(self, sent: Proposal, verdict: Verdict, drafted: int) -> None:
        if verdict.finished or not sent.runner_up:
            return
        accepted = min(verdict.accepted, drafted)
        for j in range(min(drafted, len(sent.runner_up))):
            hit = accepted == j and len(verdict.token_ids) > j and verdict.token_ids[j] == sent.runner_up[j]
            self.rate[j] = ewma(self.rate.get(j, ODDS_PRIOR), float(hit), ODDS_ALPHA)

    def pick(self, sent: Proposal, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` (j, runner-up) alternatives of ``sent``, likeliest first, of those that came
        true at least :data:`BRANCH_MIN_ODDS` of the time."""
        ups = [(j, up) for j, up in enumerate(sent.runner_up[: len(sent.token_ids)])
               if 0 <= up != sent.token_ids[j] and self.rate.get(j, ODDS_PRIOR) >= BRANCH_MIN_ODDS]
        ups.sort(key=lambda alt: -self.rate.get(alt[0], ODDS_PRIOR))
        return ups[:n]


def _positioned(steps: Sequence[StepFeatures], budget: int) -> list[StepFeatures]:
    """A ready draft's step features as a round beginning with it would have seen them."""
    return [replace(step, position=i, budget=budget) for i, step in enumerate(steps)]


def _rest(proposal: Proposal, cut: int, k: int | None = None) -> Proposal:
    """The proposal's tokens from ``cut`` on (at most ``k``), with their q, features and runner-ups
    (a sampled lookahead's q may lack its first token's, so it is aligned from the end)."""
    end = len(proposal.token_ids) if k is None else min(len(proposal.token_ids), cut + k)
    q = None if proposal.q is None else proposal.q[len(proposal.q) - len(proposal.token_ids) + cut:][: end - cut]
    return Proposal(token_ids=proposal.token_ids[cut:end], steps=proposal.steps[cut:end], q=q,
                    runner_up=proposal.runner_up[cut:end])


async def _one_token_at_a_time(batcher: DraftBatcher, job: DraftJob) -> tuple[Proposal, float, float]:
    """Draft the lookahead one token per batch, so a round that becomes ready meanwhile waits for
    one forward at most, never for a whole lookahead (the batcher drafts rounds first).

    A sampled lookahead's q covers its tokens after the first: the first guesses the verifier's own
    token (``job.after.guess``), which replaces it in any case, so it has no q (``Lookahead.settle``
    aligns the rest from the end)."""
    tokens: list[int] = []
    ups: list[int] = []
    steps: list[StepFeatures] = []
    qs: list[SparseQ] | None = None
    started = ended = 0.0
    while len(tokens) < job.k:
        guess = job.after.guess if not tokens else None  # only the first token guesses the verifier's
        after = replace(job.after, assume=(*job.after.assume, *tokens), guess=guess)
        # one token a batch, and those that come free with it (a draft model's looked-up rows)
        step, began, ended = await batcher.propose(replace(job, k=1, after=after, spare=job.k - len(tokens) - 1))
        started = started or began
        tokens += step.token_ids
        ups += step.runner_up
        steps += step.steps
        if step.q is not None:
            qs = [*(qs or []), *step.q]
        if not step.token_ids or step.final:  # an end token, or the controller stopped it
            break
    whole = qs is not None and len(qs) == len(tokens) - (job.after.guess is not None)
    return Proposal(token_ids=tokens, q=qs if whole else None, steps=steps,
                    runner_up=ups if len(ups) == len(tokens) else []), started, ended


async def _drop(task: asyncio.Task[tuple[Proposal, float, float]]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
