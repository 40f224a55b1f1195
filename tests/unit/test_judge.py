"""The batch acceptance step: one vectorised pass gives exactly the per-session verdicts.

``judge`` must agree with the reference rules of ``shared.acceptance`` applied to each session
alone (same generator, same draws), whatever mix of greedy and sampled sessions, sampling
settings, draft lengths and q kinds shares the batch.
"""

from __future__ import annotations

import pytest
import torch

from services.verifier.judge import judge
from services.verifier.requests import Request
from shared.acceptance import verify_greedy, verify_sampled
from shared.draft_q import check, pack
from shared.protocol import SamplingParams, SparseQ
from shared.sampling import make_generator, probs_from_logit_rows, probs_from_logits
from tests.verifier_requests import make_request

VOCAB = 40
MIXED = [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.6, seed=3),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, seed=4),
]


def _request(i: int, params: SamplingParams) -> Request:
    return make_request(f"r{i}", [1, 2, 3], params, True, 512, frozenset())


def _sparse(gen: torch.Generator, token: int) -> SparseQ:
    ids = sorted({token, *torch.randint(0, VOCAB, (5,), generator=gen).tolist()})
    probs = torch.rand(len(ids), generator=gen) + 0.05
    return pack(torch.tensor(ids), (probs / probs.sum()).half())


def test_rows_with_their_own_settings_equal_each_row_alone() -> None:
    logits = torch.randn(len(MIXED) - 1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    sampled = [p for p in MIXED if p.temperature > 0]
    rows = probs_from_logit_rows(logits, [p.temperature for p in sampled], [p.top_k for p in sampled],
                                 [p.top_p for p in sampled])
    for i, params in enumerate(sampled):
        torch.testing.assert_close(rows[i], probs_from_logits(logits[i], params))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_q", [False, True])
def test_batch_verdicts_equal_each_session_judged_alone(seed: int, with_q: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, rows = [], []
    for i, params in enumerate(MIXED):
        k = (seed + i) % 5  # 0..4 drafts, an empty draft included
        drafts = torch.randint(0, VOCAB, (k,), generator=gen).tolist()
        req = _request(i, params)
        if with_q and params.temperature > 0:
            req.round.draft.q = [check(_sparse(gen, t), t, VOCAB) for t in drafts]
        batch.append((req, drafts))
        rows.append(torch.randn(k + 1, VOCAB, generator=gen) * 2)
    got = judge(batch, torch.cat(rows))
    for (req, drafts), logits, verdict in zip(batch, rows, got, strict=True):
        alone = make_generator(req.params.seed, "verify")
        if req.greedy:
            n, extra = verify_greedy(drafts, logits.argmax(-1).tolist())
        else:
            q = [cq.dense(VOCAB) for cq in req.round.draft.q] if req.round.draft.q else None
            n, extra = verify_sampled(drafts, probs_from_logits(logits, req.params), q, alone)
        assert (verdict.accepted, verdict.tokens) == (n, [*drafts[:n], extra])
