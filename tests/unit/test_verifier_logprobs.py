"""Logprobs of a round's committed tokens are read off the rows that predicted them.

``judge`` attaches, for each session that asked, one TokenLogprob per committed token: the
token's log-probability on its own row (raw: log-softmax of the logits; processed: the log of
the distribution sampled from), and the top-N of that row, most likely first.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from services.verifier.judge import judge
from services.verifier.requests import Request
from shared.protocol import SamplingParams, TokenEvent, TokenLogprob, decode, encode
from shared.sampling import probs_from_logits
from tests.verifier_requests import make_request

VOCAB = 30
CASES = [  # (params, drafts)
    (SamplingParams(temperature=0.0, logprobs=3), [4, 7, 9]),
    (SamplingParams(temperature=1.0, seed=1, logprobs=0), [1, 2]),
    (SamplingParams(temperature=0.7, top_k=4, seed=2, logprobs=2, logprobs_mode="processed"), [3, 3, 3, 3]),
    (SamplingParams(temperature=0.0, logprobs=2, logprobs_mode="processed"), []),
    (SamplingParams(temperature=0.9, seed=3), [5]),  # asked for none
]


def _batch(seed: int) -> tuple[list[tuple[Request, list[int]]], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batch = [(make_request(f"r{i}", [1, 2], p, True, 512, frozenset()), d) for i, (p, d) in enumerate(CASES)]
    rows = [torch.randn(len(d) + 1, VOCAB, generator=gen) * 3 for _, d in batch]
    return batch, rows


def _expected(params: SamplingParams, row: torch.Tensor) -> torch.Tensor:
    if params.logprobs_mode == "raw" or params.temperature == 0:
        return row.log_softmax(-1)
    return probs_from_logits(row, params).log()


@pytest.mark.parametrize("seed", range(4))
def test_each_committed_token_gets_its_rows_logprob_and_top_n(seed: int) -> None:
    batch, rows = _batch(seed)
    for (req, _), logits, verdict in zip(batch, rows, judge(batch, torch.cat(rows)), strict=True):
        if req.params.logprobs is None:
            assert verdict.logprobs is None
            continue
        assert verdict.logprobs is not None and len(verdict.logprobs) == len(verdict.tokens)
        for j, (token, lp) in enumerate(zip(verdict.tokens, verdict.logprobs, strict=True)):
            want = _expected(req.params, logits[j])
            assert lp.logprob == pytest.approx(float(want[token]), abs=1e-5)
            top = want.topk(req.params.logprobs or 0)
            assert lp.top_ids == top.indices.tolist()
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
        if req.greedy:  # the chosen token is the argmax: its logprob is the top-1
            assert all(lp.top_ids[0] == t for t, lp in zip(verdict.tokens, verdict.logprobs, strict=True))


def test_processed_logprobs_are_minus_infinity_outside_top_k() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, seed=0, logprobs=5, logprobs_mode="processed")
    req = make_request("r", [1], params, True, 512, frozenset())
    verdict = judge([(req, [])], torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0))[0]
    assert verdict.logprobs is not None
    assert verdict.logprobs[0].top_ids[:2] == [VOCAB - 1, VOCAB - 2]
    assert [math.isinf(x) for x in verdict.logprobs[0].top_logprobs] == [False, False, True, True, True]


def test_token_event_logprobs_round_trip_the_wire() -> None:
    event = TokenEvent(request_id="r", origin="c", token_ids=[3], text="x",
                       logprobs=[TokenLogprob(logprob=-0.5, top_ids=[3, 4], top_logprobs=[-0.5, -1.5])])
    assert decode(encode(event)) == event
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"logprobs": 21}, SamplingParams)
