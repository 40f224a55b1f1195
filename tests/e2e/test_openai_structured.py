"""Structured output (response_format, guided_*) and vLLM's extension fields through the real
fleet and the openai SDK: outputs always parse, a tiny grammar's sampled distribution is the
target's masked one, and tool calling is refused clearly. The fleet and its fixtures are the
ones of ``test_openai_features.py``."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import Any

import pytest
import torch

from services.verifier.grammar import Grammars
from shared.models import LoadedModel
from shared.protocol import Structured
from tests.e2e import test_openai_features as features
from tests.e2e.penalty_reference import greedy_with_penalties
from tests.e2e.stack import Stack
from tests.e2e.test_full_stack import SAMPLES, stream_many

pytestmark = pytest.mark.e2e

target = features.target  # the fixtures: one fleet for this module too
stack = features.stack
client = features.client
PENALTIES, penalty_body = features.PENALTIES, features.penalty_body


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "ok", "size"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "size": {"enum": [1, 2, 3]}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def test_json_schema_outputs_always_parse(stack: Stack) -> None:
    import jsonschema

    body = {"kind": "completion", "prompt": "x = ", "max_tokens": 120, "temperature": 1.0,
            "response_format": RESPONSE_FORMAT}
    results = asyncio.run(stream_many(stack, [{**body, "seed": seed} for seed in range(200)]))
    for _, text, done in results:
        assert done["finish_reason"] == "stop", (text, done)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for _, text, _ in results}) > 3  # sampled, not one fixed answer


def sdk_chat(client: Any, stream: bool, **kwargs: Any) -> tuple[str, str]:
    """The text of one chat completion through the SDK, and its finish reason."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    return "".join(c.delta.content or "" for c in chunks), next(c.finish_reason for c in chunks if c.finish_reason)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_through_the_sdk(client: Any, stream: bool) -> None:
    """Every output that ends is a JSON object. A free-form JSON string may still run past max_tokens
    (the tiny random model rambles), so a few seeds are tried and at least one must end."""
    messages = [{"role": "user", "content": "a json object please"}]
    kwargs: dict[str, Any] = dict(model="target", messages=messages, max_tokens=200, temperature=0.7)
    for fmt in [{"type": "json_object"}, RESPONSE_FORMAT]:
        ended = 0
        for seed in range(1, 6):
            text, reason = sdk_chat(client, stream, response_format=fmt, seed=seed, **kwargs)
            assert reason in ("stop", "length"), reason
            if reason == "stop":
                assert isinstance(json.loads(text), dict), text
                ended += 1
        assert ended, f"no {fmt['type']} output ended within {kwargs['max_tokens']} tokens"
    out = client.completions.create(model="target", prompt="n = ", max_tokens=20, temperature=1.0, seed=2,
                                    extra_body={"guided_regex": "[1-9][0-9]{2}-[a-c]+"}).choices[0]
    assert re.fullmatch("[1-9][0-9]{2}-[a-c]+", out.text) and out.finish_reason == "stop", out.text


def sdk_text(client: Any, stream: bool, **kwargs: Any) -> str:
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    return str(client.completions.create(**kwargs).choices[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_extensions_through_the_sdk(client: Any, target: LoadedModel, stream: bool) -> None:
    """vLLM's extension fields as its clients send them (``extra_body``), streaming and not:
    repetition_penalty and logit_bias against the transformers reference, the guided_* grammars,
    and ``user`` accepted."""
    import jsonschema

    prompt = "while True:\n    "
    ids = list(target.tokenizer(prompt)["input_ids"])
    for name in ("repetition", "negative+bias"):
        params = PENALTIES[name]
        want = greedy_with_penalties(target.model, ids, 24, params, target.eos_ids)
        body = penalty_body(params)
        text = sdk_text(client, stream, model="target", prompt=prompt, max_tokens=24, temperature=0, user="u-1",
                        logit_bias=body.pop("logit_bias"), extra_body=body)
        assert text == target.tokenizer.decode(want, skip_special_tokens=True), name
    common: dict[str, Any] = dict(model="target", prompt="x = ", max_tokens=120, temperature=1.0, seed=4)
    choice = sdk_text(client, stream, extra_body={"guided_choice": ["alpha", "beta", "gamma"]}, **common)
    assert choice in ("alpha", "beta", "gamma"), choice
    jsonschema.validate(json.loads(sdk_text(client, stream, extra_body={"guided_json": SCHEMA}, **common)), SCHEMA)
    regex = sdk_text(client, stream, extra_body={"guided_regex": "[1-9][0-9]{2}-[a-c]+"}, **common)
    assert re.fullmatch("[1-9][0-9]{2}-[a-c]+", regex), regex


def test_tool_calling_is_refused_through_the_sdk(client: Any) -> None:
    from openai import BadRequestError

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(BadRequestError, match="tool calling"):
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], tools=[tool])


def test_a_grammar_that_does_not_compile_is_an_error_naming_it(client: Any) -> None:
    from openai import InternalServerError

    with pytest.raises(InternalServerError, match="regex"):
        client.completions.create(model="target", prompt="x", max_tokens=4, extra_body={"guided_regex": "(open"})


CHOICES = ["red", "green", "blue"]


@torch.inference_mode()
def choice_distribution(target: LoadedModel, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every token sequence the target alone can produce under guided_choice CHOICES (temperature
    1), with its probability: at each step p is masked by the grammar's mask after that exact
    prefix (a fresh matcher advanced over the prefix: no drafts, no rollback), renormalised.

    The grammar library decides which tokenizations are allowed (llguidance allows only the
    canonical tokenization of forced text: after "g" only "re", never "r"), so the masks come
    from it, as they would for the target alone.
    """
    grammars = Grammars(target.tokenizer, target.vocab_size)
    spec = Structured(kind="choice", spec=json.dumps(CHOICES))
    out: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[list[int], float]] = [([], 1.0)]
    while frontier:
        ids, prob = frontier.pop()
        grammar = grammars.matcher(spec)
        grammar.advance(ids)
        allowed = grammar.masks([])[0].nonzero().flatten().tolist()
        p = target.model(torch.tensor([prompt + ids])).logits[0, -1].float().softmax(-1)[allowed]
        p = p / p.sum()
        for t, q in zip(allowed, p.tolist(), strict=True):
            if t in target.eos_ids:
                out[(*ids, t)] = out.get((*ids, t), 0.0) + prob * q
            else:
                frontier.append(([*ids, t], prob * q))
    return out


@pytest.mark.stat
def test_guided_choice_has_the_targets_masked_distribution(stack: Stack, target: LoadedModel) -> None:
    from tests.e2e.lossless_stats import chi_square_p

    prompt = "color = "
    law = choice_distribution(target, list(target.tokenizer(prompt)["input_ids"]))
    assert abs(sum(law.values()) - 1.0) < 1e-6 and len(law) >= 3
    order = sorted(law, key=lambda k: -law[k])
    body = {"kind": "completion", "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
            "guided_choice": CHOICES}
    n = SAMPLES // 2
    results = asyncio.run(stream_many(stack, [{**body, "seed": seed} for seed in range(n)]))
    seen = Counter(order.index(tuple(ids)) for ids, _, _ in results)  # a sequence outside the law raises
    p_value = chi_square_p(seen, [law[k] for k in order], n)
    print(f"{len(law)} sequences, p = {p_value}")
    assert p_value > 0.001
