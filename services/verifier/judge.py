"""The acceptance step over one batch: from the target's logits to each session's verdict.

The forward pass returns logits rows for every verified session, back to back: for a session
with k drafts, k + 1 rows (its last committed token, then each draft). Work is vectorised over
the whole batch where the maths allows:

* one argmax over every row serves all greedy sessions (no softmax, no copy; numpy's, which is
  vectorised: ``shared.runner.topk.row_argmax``);
* a raced session (``shared.race``) is judged as a greedy one, against each row's race winner;
* one call turns the sampled sessions' rows into their distributions, each row with its own
  temperature, top-k and top-p; one gather reads p(x) of every drafted token;
* one ``.tolist()`` each brings those to Python; per session there remain its k uniforms and
  one draw from its generator, from the residual or the bonus row (or, for a bonus the drafter
  guesses, the keyed race of ``shared.coupling``), all of which reach the host in one transfer
  (two synchronisations per step on a GPU, whatever the batch).

The rules themselves are the pure functions of ``shared.acceptance``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from services.verifier.logprobs import round_logprobs
from services.verifier.requests import Request
from shared.acceptance import accepted_prefix, one_hot, residual, verify_greedy
from shared.coupling import race_winner
from shared.penalties import apply_penalties, has_penalties
from shared.protocol import TokenLogprob
from shared.race import winners
from shared.runner.topk import row_argmax
from shared.sampling import probs_from_logit_rows, sample


@dataclass(frozen=True)
class Judgement:
    accepted: int
    tokens: list[int]  # accepted drafts, then the target's own token
    #: Σ over every draft of its acceptance probability min(1, p/q) (GoodSpeed eq. 3); for a
    #: greedy request 1 where the draft is the target's argmax given the drafts before it, else 0
    accept_prob: float = 0.0
    #: the logprobs of ``tokens`` when the request asked for them (services.verifier.logprobs)
    logprobs: list[TokenLogprob] | None = None


def judge(batch: Sequence[tuple[Request, list[int]]], raw: torch.Tensor) -> list[Judgement]:
    """Verdicts for ``batch`` (request, drafts verified) whose rows fill ``raw`` (the target's
    logits) in order. Sessions with penalties are judged on their penalised rows."""
    logits = penalized(batch, raw)
    starts, row = [], 0
    for _, drafts in batch:
        starts.append(row)
        row += len(drafts) + 1
    out: list[Judgement | None] = [None] * len(batch)
    greedy = [i for i, (req, _) in enumerate(batch) if req.greedy]
    if greedy:
        argmax = row_argmax(logits)
        for i in greedy:
            drafts = batch[i][1]
            out[i] = _against(drafts, argmax[starts[i] : starts[i] + len(drafts) + 1])
    for judged, raced in ((_judge_raced, True), (_judge_sampled, False)):
        some = [i for i, (req, _) in enumerate(batch) if not req.greedy and (req.sampler.race_key is not None) == raced]
        if some:
            for i, verdict in zip(some, judged([batch[i] for i in some], [starts[i] for i in some], logits),
                                  strict=True):
                out[i] = verdict
    verdicts = [v for v in out if v is not None]
    if any(req.params.logprobs is not None for req, _ in batch):  # read off the same rows: no extra pass
        logprobs = round_logprobs(batch, raw, logits, [v.tokens for v in verdicts])
        verdicts = [replace(v, logprobs=lp) for v, lp in zip(verdicts, logprobs, strict=True)]
    return verdicts


def penalized(batch: Sequence[tuple[Request, list[int]]], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with each session's penalties applied to its rows, row j counting the session's
    drafts before it as generated (shared.penalties), and its grammar's mask at each row's prefix
    (services.verifier.grammar); ``logits`` itself when no session has either."""
    if not any(has_penalties(req.params) or req.sampler.grammar is not None for req, _ in batch):
        return logits
    out, start = logits.float().clone(), 0
    for req, drafts in batch:
        end = start + len(drafts) + 1
        if has_penalties(req.params):
            out[start:end] = apply_penalties(out[start:end], req.params, req.committed[: req.prompt_len],
                                             req.committed[req.prompt_len :], drafts)
        if req.sampler.grammar is not None:
            allowed = req.sampler.grammar.masks(drafts).to(out.device)
            out[start:end] = out[start:end].masked_fill(~allowed, float("-inf"))
        start = end
    return out


def _distributions(batch: Sequence[tuple[Request, list[int]]], starts: list[int],
                   logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The sampled distribution of every row of ``batch``'s sessions, in one call (each row with its
    session's temperature, top-k and top-p), and where each session's rows start in it."""
    rows = [r for s, (_, d) in zip(starts, batch, strict=True) for r in range(s, s + len(d) + 1)]
    if len(rows) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
    params = [req.params for req, d in batch for _ in range(len(d) + 1)]
    p = probs_from_logit_rows(logits, [x.temperature for x in params], [x.top_k for x in params],
                              [x.top_p for x in params])
    local, offset = [], 0
    for _, drafts in batch:
        local.append(offset)
        offset += len(drafts) + 1
    return p, local


def _judge_raced(batch: Sequence[tuple[Request, list[int]]], starts: list[int],
                 logits: torch.Tensor) -> list[Judgement]:
    """Raced sessions (shared.race): the target's token at each row is the row's race winner, so the
    drafts are judged as greedy ones against the winners (row j is the request's position
    ``len(committed) + j``)."""
    p, local = _distributions(batch, starts, logits)
    out = []
    for (req, drafts), start in zip(batch, local, strict=True):
        assert req.sampler.race_key is not None
        first = len(req.committed)
        out.append(_against(drafts, winners(p[start : start + len(drafts) + 1], req.sampler.race_key,
                                            range(first, first + len(drafts) + 1))))
    return out


def _against(drafts: list[int], targets: list[int]) -> Judgement:
    """A round judged against the target's own token at each row (its argmax, or its race's
    winner): drafts accepted while they equal it, then the target's token; each draft's
    acceptance probability is 1 where it equals the target's token, else 0."""
    n, extra = verify_greedy(drafts, targets)
    return Judgement(n, [*drafts[:n], extra], float(sum(d == t for d, t in zip(drafts, targets, strict=False))))


def _judge_sampled(batch: Sequence[tuple[Request, list[int]]], starts: list[int],
                   logits: torch.Tensor) -> list[Judgement]:
    """Sampled sessions: their distributions in one call, p(x) of every draft in one gather and one
    transfer, then per session its uniforms; the rows left to sample from (a residual, or the bonus
    row) are built where the logits live and moved to the host together."""
    p, local = _distributions(batch, starts, logits)
    draft_rows = [local[b] + j for b, (_, d) in enumerate(batch) for j in range(len(d))]
    draft_ids = [t for _, d in batch for t in d]
    p_x = p[draft_rows, draft_ids].tolist() if draft_ids else []
    accepted, probs, last, at = [], [], [], 0
    for (req, drafts), start in zip(batch, local, strict=True):
        k = len(drafts)
        n, prob = _accepted(req, drafts, p_x[at : at + k])
        at += k
        accepted.append(n)
        probs.append(prob)
        last.append(p[start + k] if n == k else residual(p[start + n], _q_row(req, drafts, n, p.shape[-1], p.device)))
    final = torch.stack(last).cpu()
    return [Judgement(n, [*drafts[:n], _own_token(req, final[i], races(req, drafts, n))], probs[i])
            for i, ((req, drafts), n) in enumerate(zip(batch, accepted, strict=True))]


def races(req: Request, drafts: list[int], accepted: int) -> bool:
    """Whether the round's own token is drawn by the keyed race (shared.coupling): the drafter
    asked, and the verifier verified its whole draft (not trimmed) and accepted all of it."""
    return req.round.draft.guess_bonus and accepted == len(drafts) == len(req.round.draft.ids)


def _own_token(req: Request, row: torch.Tensor, race: bool) -> int:
    """The verifier's token from ``row`` (a residual, or the bonus row): by the keyed race of the
    round when ``race``, else from the request's stream."""
    if race:
        return race_winner(row, req.sampler.bonus_key, req.round.number)
    return sample(row, req.sampler.gen)


def _accepted(req: Request, drafts: list[int], p_x: list[float]) -> tuple[int, float]:
    """Accepted drafts, and Σ min(1, p/q) over all of them."""
    k = len(drafts)
    q = req.round.draft.q
    q_x = [q[j].token_prob for j in range(k)] if q else [1.0] * k
    n = accepted_prefix(p_x, q_x, torch.rand(k, generator=req.sampler.gen).tolist() if k else [])
    return n, sum(min(1.0, p / q) if q > 0 else 1.0 for p, q in zip(p_x, q_x, strict=True))


def _q_row(req: Request, drafts: list[int], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The dense q the rejected draft n was drawn from: its sparse q, or one-hot (ids-only)."""
    q = req.round.draft.q
    if not q:
        return one_hot(drafts[n], vocab).to(device)
    return q[n].dense(vocab).to(device)
