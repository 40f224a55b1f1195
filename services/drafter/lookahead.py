"""Pipelined drafting: draft the next round while this one is being verified.

After a session sends its Draft, it asks the batcher for a *lookahead*: tokens that continue the
sent draft as if the verifier accepted all of it (SpecEdge's proactive edge drafting). The first
lookahead token guesses the verifier's own token after a fully accepted draft; the rest continue
from that guess. When the Verdict accepts every draft and its last token equals the guess, the
rest of the lookahead is the next round's draft, ready at once, its keys and values already in
the draft cache. (A continuous verifier such as vLLM may commit several tokens after the draft:
then the lookahead must have guessed them all.) Otherwise it is dropped (the proposer's
rollback discards it from the cache).

The draft model would sit idle during verification anyway, so a dropped lookahead costs only
edge compute, and a batched lookahead rides along with other sessions' drafts.

A lookahead is drafted without the session's controller (it is not a round), but with the
step features the controller reads; the round that takes it lets the controller screen it token
by token, so a policy stops a ready draft where it would have stopped a fresh one.

Greedy requests pipeline: their drafts are argmax and draw no randomness, so whether a
lookahead ran or was used never changes a seeded request's random stream. Unseeded sampled
requests pipeline too, when the verifier couples its bonus token (``shared.coupling``): the
first lookahead token is then the winner of the same race the verifier runs, over the draft
model's distribution instead of the target's, and the rest are sampled from the drafting stream
with their q, as in any round. (A seeded request does not: its stream would then depend on
timing.)
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from services.drafter.batcher import DraftBatcher
from services.drafter.control.base import DraftController, StepDecision, StepFeatures
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import DraftJob, Proposal
from shared.protocol import SparseQ, Verdict


class Lookahead:
    """One session's lookahead: at most one in flight, and at most one ready draft."""

    def __init__(self) -> None:
        self._task: asyncio.Task[tuple[Proposal, float, float]] | None = None
        self._ready: Proposal | None = None

    def start(self, batcher: DraftBatcher, job: DraftJob) -> None:
        """Draft ``job`` (its ``assume`` is the Draft just sent) while the verdict is awaited."""
        self.cancel()
        self._task = asyncio.create_task(_one_token_at_a_time(batcher, job), name=f"lookahead-{job.session_id}")

    def take(self, k: int, controller: DraftController | None = None) -> Proposal | None:
        """The next round's draft, if the last lookahead came true: at most ``k`` tokens, and
        screened by the session's controller as if it had watched them being drafted."""
        ready, self._ready = self._ready, None
        if ready is None or k <= 0:
            return None
        n = min(k, len(ready.token_ids))
        if controller is not None and controller.wants_features and len(ready.steps) >= n:
            n = _screen(controller, ready.steps[:n], k)
        q = None if ready.q is None else ready.q[:n]
        return Proposal(token_ids=ready.token_ids[:n], q=q, steps=ready.steps[:n])

    async def settle(self, verdict: Verdict, drafted: int, metrics: DrafterMetrics) -> None:
        """Keep the lookahead when the verdict made its guess true; drop it otherwise."""
        task, self._task = self._task, None
        if task is None:
            return
        if verdict.finished or verdict.accepted < drafted or not verdict.token_ids:
            await _drop(task)
            metrics.lookahead.labels("dropped").inc()
            return
        try:
            proposal, _, _ = await task
        except Exception:  # the batcher logged it; the round simply drafts afresh
            return
        after = list(verdict.token_ids[drafted:])  # the verifier's own tokens (vLLM may commit several)
        if proposal.token_ids[:len(after)] == after and len(proposal.token_ids) > len(after):
            cut = len(after)  # at least the guessed token, whose q the lookahead never kept (see below)
            q = None if proposal.q is None else proposal.q[len(proposal.q) - len(proposal.token_ids) + cut:]
            self._ready = Proposal(token_ids=proposal.token_ids[cut:], steps=proposal.steps[cut:], q=q)
            metrics.lookahead.labels("used").inc()
        else:
            metrics.lookahead.labels("missed").inc()

    def cancel(self) -> None:
        self._ready = None
        if self._task is not None:
            self._task.cancel()
            self._task = None


def _screen(controller: DraftController, steps: list[StepFeatures], budget: int) -> int:
    """How many of a ready lookahead's tokens the controller keeps (its round has begun)."""
    for i, step in enumerate(steps):
        decision = controller.on_step(replace(step, position=i, budget=budget))
        if decision is StepDecision.DISCARD:
            return i
        if decision is StepDecision.STOP:
            return i + 1
    return len(steps)


async def _one_token_at_a_time(batcher: DraftBatcher, job: DraftJob) -> tuple[Proposal, float, float]:
    """Draft the lookahead one token per batch, so a round that becomes ready meanwhile waits for
    one forward at most, never for a whole lookahead (the batcher drafts rounds first).

    A sampled lookahead's q covers its tokens after the first: the first guesses the verifier's own
    token (``job.guess``), which replaces it in any case, so it has no q (``Lookahead.settle``
    aligns the rest from the end)."""
    tokens: list[int] = []
    steps: list[StepFeatures] = []
    qs: list[SparseQ] | None = None
    started = ended = 0.0
    for i in range(job.k):
        guess = job.guess if i == 0 else None  # only the first token guesses the verifier's
        step, began, ended = await batcher.propose(replace(job, k=1, assume=(*job.assume, *tokens), guess=guess))
        started = started or began
        tokens += step.token_ids
        steps += step.steps
        if step.q is not None:
            qs = [*(qs or []), *step.q]
        if not step.token_ids or step.final:  # an end token, or the controller stopped it
            break
    whole = qs is not None and len(qs) == len(tokens) - (job.guess is not None)
    return Proposal(token_ids=tokens, q=qs if whole else None, steps=steps), started, ended


async def _drop(task: asyncio.Task[tuple[Proposal, float, float]]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
