"""Logprobs of the committed tokens, from the verifier's own logits: no extra forward pass.

Every token a round commits (each accepted draft, then the verifier's own token) sits on a row
of the logits the acceptance step already has, so its logprob and the top-N alternatives are
one log-softmax and one top-k over those rows. Two modes, as vLLM v1 offers them:

* ``raw`` (the default): ``log_softmax(logits)``, the target's distribution before any sampling
  processing: what the model itself thinks, independent of temperature, top-k and top-p;
* ``processed``: the log of the distribution the token was actually drawn from (after the
  penalties, temperature, top-k and top-p; tokens cut away have logprob -inf). A greedy request
  samples from no distribution: its processed logprobs are the log-softmax of its penalised
  logits, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.verifier.requests import Request
from shared.protocol import TokenLogprob
from shared.sampling import probs_from_logit_rows


def round_logprobs(batch: Sequence[tuple[Request, list[int]]], raw: torch.Tensor, processed: torch.Tensor,
                   tokens: Sequence[list[int]]) -> list[list[TokenLogprob] | None]:
    """Per session of ``batch``: the logprobs of its round's ``tokens`` (None if it asked for none),
    from the target's ``raw`` logits or the ``processed`` ones (penalties applied), as it asked.

    Session i's rows start where the rows of the sessions before it end (k + 1 rows for k
    drafts); its j-th committed token sits on row j, the row that predicted it.
    """
    out: list[list[TokenLogprob] | None] = []
    start = 0
    for (req, drafts), toks in zip(batch, tokens, strict=True):
        rows = (raw if req.params.logprobs_mode == "raw" else processed)[start : start + len(toks)]
        start += len(drafts) + 1
        out.append(None if req.params.logprobs is None else _logprobs(req, rows, toks))
    return out


def _logprobs(req: Request, rows: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
    logp = log_distribution(req, rows)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    n = req.params.logprobs or 0
    top_vals, top_ids = logp.topk(n, dim=-1) if n else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(logprob=c, top_ids=i, top_logprobs=v)
            for c, i, v in zip(chosen, top_ids.tolist(), top_vals.tolist(), strict=True)]


def log_distribution(req: Request, rows: torch.Tensor) -> torch.Tensor:
    """The log-probabilities ``[R, V]`` the request's logprobs are read from (see the module)."""
    params = req.params
    if params.logprobs_mode == "raw" or req.greedy:
        return rows.float().log_softmax(-1)
    n = rows.shape[0]
    probs = probs_from_logit_rows(rows, [params.temperature] * n, [params.top_k] * n, [params.top_p] * n)
    return probs.log()
