"""Penalties on logits, as a table of hand-computed cases, and their use inside a verified round.

Row j of a round predicts the token after drafts 0..j-1, so it must count those drafts as
generated: judging a round at once must equal decoding the same tokens one at a time.
"""

from __future__ import annotations

import pytest
import torch

from services.verifier.judge import judge
from services.verifier.vllm_engine.engine import vllm_unsupported
from shared.penalties import apply_penalties, has_penalties
from shared.protocol import SamplingParams
from shared.sampling import SamplingError, validate
from tests.verifier_requests import make_request

LOGITS = [2.0, -1.0, 0.5, 0.0, 3.0]
CASES = [  # (id, params, prompt, generated, expected row)
    ("none", SamplingParams(), [0], [1], LOGITS),
    ("presence", SamplingParams(presence_penalty=0.5), [0], [1, 1, 4], [2.0, -1.5, 0.5, 0.0, 2.5]),
    ("presence ignores the prompt", SamplingParams(presence_penalty=0.5), [0, 2], [], LOGITS),
    ("frequency", SamplingParams(frequency_penalty=0.25), [0], [1, 1, 4], [2.0, -1.5, 0.5, 0.0, 2.75]),
    ("negative frequency", SamplingParams(frequency_penalty=-1.0), [], [3, 3], [2.0, -1.0, 0.5, 2.0, 3.0]),
    ("repetition divides positives, multiplies negatives, prompt too", SamplingParams(repetition_penalty=2.0),
     [0], [1, 3], [1.0, -2.0, 0.5, 0.0, 3.0]),
    ("logit_bias", SamplingParams(logit_bias={2: 10.0, 4: -100.0}), [], [], [2.0, -1.0, 10.5, 0.0, -97.0]),
    ("bias before repetition", SamplingParams(logit_bias={0: 2.0}, repetition_penalty=2.0), [0], [],
     [2.0, -1.0, 0.5, 0.0, 3.0]),
    ("all together", SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0), [4], [4],
     [2.0, -1.0, 0.5, 0.0, 0.0]),
]


@pytest.mark.parametrize(("params", "prompt", "generated", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_penalty_table(params: SamplingParams, prompt: list[int], generated: list[int], want: list[float]) -> None:
    got = apply_penalties(torch.tensor([LOGITS]), params, prompt, generated)
    assert got[0].tolist() == pytest.approx(want)
    assert has_penalties(params) == (params != SamplingParams())


def test_row_j_counts_the_drafts_before_it() -> None:
    params = SamplingParams(frequency_penalty=1.0)
    got = apply_penalties(torch.zeros(3, 5), params, [0], [2], drafts=[2, 3])
    assert got.tolist() == [[0, 0, -1, 0, 0], [0, 0, -2, 0, 0], [0, 0, -2, -1, 0]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={3: 1.0}),
])
def test_a_round_at_once_equals_one_token_at_a_time(params: SamplingParams) -> None:
    """Greedy with strong penalties on logits that favour repeating: the round's verdict (drafts
    accepted and the extra token) equals decoding each position with its own true prefix."""
    vocab, prompt = 12, [1, 2, 3]
    rows = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    rows[:, 5] += 4.0  # every row prefers token 5, until penalties push it down
    generated: list[int] = []
    for j in range(rows.shape[0]):
        generated.append(int(apply_penalties(rows[j : j + 1], params, prompt, generated)[0].argmax()))
    req = make_request("r", prompt, params, True, 512, frozenset())
    verdict = judge([(req, generated[:5])], rows)[0]
    assert verdict.accepted == 5 and verdict.tokens == generated
    unpenalized = judge([(make_request("s", prompt, SamplingParams(temperature=0.0), True, 512, frozenset()),
                          generated[:5])], rows)[0]
    assert unpenalized.tokens != generated  # the penalties changed the outcome


@pytest.mark.parametrize(("params", "param"), [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
])
def test_out_of_range_penalties_name_their_field(params: SamplingParams, param: str) -> None:
    with pytest.raises(SamplingError) as err:
        validate(params, 3, 512)
    assert err.value.param == param


def test_vllm_backend_names_what_it_refuses() -> None:
    assert vllm_unsupported(SamplingParams(temperature=0.5, top_k=3, seed=1)) == []
    assert vllm_unsupported(SamplingParams(logprobs=0, presence_penalty=0.1, logit_bias={1: 1.0})) == [
        "logprobs", "presence_penalty", "logit_bias"]
