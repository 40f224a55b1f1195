"""OpenAI request features through the official ``openai`` client against the real fleet.

Penalties: greedy output with penalties equals a transformers reference applying the same
penalties as LogitsProcessors, token for token; sampled output passes a chi-square test
against that reference (stat tier).

Structured output: 200 seeded requests under a JSON schema all parse and validate; under
guided_choice the sampled sequences follow the target's grammar-masked law (chi-square).

Logprobs: for greedy requests the output stays token-identical to target-only greedy decoding,
and each token's logprob (and top-1) equals the target's log-softmax computed by transformers
over the whole sequence, within 1e-4; streaming and not, chat and completions. Processed
logprobs of a sampled request equal the log of the distribution sampled from.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shared.models import LoadedModel, load_model
from shared.protocol import SamplingParams
from shared.sampling import probs_from_logits
from tests.conftest import greedy_reference
from tests.e2e.lossless_stats import lossless_p_values
from tests.e2e.penalty_reference import first_two_with_penalties, greedy_with_penalties
from tests.e2e.stack import Stack, StackSpec, run_stack
from tests.e2e.test_full_stack import SAMPLES, stream_many

pytestmark = pytest.mark.e2e
TOL = 1e-4
PROMPTS = ["def parse(", "import os\n", "class Queue:"]


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["target"])


@pytest.fixture(scope="module")
def stack(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One drafter sending sparse q, so rounds commit accepted drafts and verifier tokens alike."""
    spec = StackSpec(drafts=[tiny_models["draft-L2"]], draft_mode="sampled", max_sessions=8)
    with run_stack(tiny_models["target"], spec, tmp_path_factory.mktemp("logs-openai")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


@torch.inference_mode()
def target_logits(target: LoadedModel, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The target's logits at each generated position, from one pass over the whole sequence."""
    logits = target.model(torch.tensor([prompt + generated])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def chat_ids(target: LoadedModel, text: str) -> list[int]:
    out = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_raw(target: LoadedModel, prompt: list[int], logprobs: list[float], top1: list[float]) -> None:
    """Greedy: the output is the greedy reference, and each logprob its log-softmax."""
    ref = greedy_reference(target.model, prompt, len(logprobs), target.eos_ids)
    want = target_logits(target, prompt, ref).log_softmax(-1)
    assert len(logprobs) == len(ref) > 0
    for j, token in enumerate(ref):
        assert abs(logprobs[j] - float(want[j, token])) < TOL, f"position {j}"
        assert abs(top1[j] - float(want[j].max())) < TOL, f"top-1 at position {j}"
        assert logprobs[j] == top1[j]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_targets_log_softmax(client: Any, target: LoadedModel, stream: bool) -> None:
    for prompt in PROMPTS:
        kwargs: dict[str, Any] = dict(model="target", prompt=prompt, max_tokens=20, temperature=0, logprobs=3)
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
            lps = [c.logprobs for c in chunks if c.logprobs is not None]
            token_lp = [x for lp in lps for x in lp.token_logprobs]
            tops = [t for lp in lps for t in lp.top_logprobs]
            offsets = [x for lp in lps for x in lp.text_offset]
        else:
            lp = client.completions.create(**kwargs).choices[0].logprobs
            token_lp, tops, offsets = lp.token_logprobs, lp.top_logprobs, lp.text_offset
        assert all(len(t) == 3 for t in tops) and offsets[0] == 0 and offsets == sorted(offsets)
        check_raw(target, list(target.tokenizer(prompt)["input_ids"]), token_lp, [max(t.values()) for t in tops])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_targets_log_softmax(client: Any, target: LoadedModel, stream: bool) -> None:
    for prompt in PROMPTS:
        kwargs: dict[str, Any] = dict(model="target", messages=[{"role": "user", "content": prompt}],
                                      max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
        if stream:
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            content = [e for c in chunks if c.logprobs is not None for e in c.logprobs.content]
        else:
            content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
        assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
        check_raw(target, chat_ids(target, prompt), [e.logprob for e in content],
                  [e.top_logprobs[0].logprob for e in content])


def ws_generate(stack: Stack, body: dict[str, Any]) -> tuple[list[int], list[float], list[dict[str, float]]]:
    """One request over /v1/stream: its token ids, their logprobs and their top alternatives."""
    from websockets.sync.client import connect

    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    with connect(stack.ws_url, max_size=None) as ws:
        ws.send(json.dumps(body))
        while (frame := json.loads(ws.recv()))["type"] == "token":
            ids += frame["token_ids"]
            logprobs += frame["logprobs"]["token_logprobs"]
            tops += frame["logprobs"]["top_logprobs"]
    assert frame["type"] == "done", frame
    return ids, logprobs, tops


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_logprobs_in_each_mode(stack: Stack, target: LoadedModel, mode: str) -> None:
    params = SamplingParams(temperature=0.8, top_k=8, seed=5)
    prompt = "for i in range("
    ids, logprobs, tops = ws_generate(stack, {
        "kind": "completion", "prompt": prompt, "max_tokens": 16, "temperature": 0.8, "top_k": 8, "seed": 5,
        "ignore_eos": True, "logprobs": 2, "logprobs_mode": mode})
    logits = target_logits(target, list(target.tokenizer(prompt)["input_ids"]), ids)
    want = logits.log_softmax(-1) if mode == "raw_logprobs" else probs_from_logits(logits, params).log()
    assert len(ids) == 16
    for j, token in enumerate(ids):
        assert abs(logprobs[j] - float(want[j, token])) < TOL, f"position {j}"
        assert max(tops[j].values()) == pytest.approx(float(want[j].max()), abs=TOL)


def greedy_text(target: LoadedModel, prompt_ids: list[int], n: int) -> str:
    ref = greedy_reference(target.model, prompt_ids, n, target.eos_ids)
    return str(target.tokenizer.decode(ref, skip_special_tokens=True))


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo(client: Any, target: LoadedModel, stream: bool) -> None:
    prompt = "def parse("
    ids = list(target.tokenizer(prompt)["input_ids"])
    want = greedy_text(target, ids, 12)
    for sent, echoed in [(prompt, prompt), (ids, target.tokenizer.decode(ids))]:
        kwargs: dict[str, Any] = dict(model="target", prompt=sent, max_tokens=12, temperature=0, echo=True)
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert text == echoed + want


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_repeats_a_final_assistant_message(client: Any, stream: bool) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "class Q"}]
    kwargs: dict[str, Any] = dict(model="target", messages=messages, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    if stream:
        echoed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            stream=True, extra_body={"echo": True}, **kwargs) if c.choices)
    else:
        echoed = client.chat.completions.create(extra_body={"echo": True}, **kwargs).choices[0].message.content
    assert echoed == "class Q" + plain


def test_echo_with_logprobs_is_refused(client: Any) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        client.completions.create(model="target", prompt="x", max_tokens=2, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(client: Any, target: LoadedModel, stream: bool) -> None:
    prompt = "import os\n"
    full = greedy_text(target, list(target.tokenizer(prompt)["input_ids"]), 30)
    found = re.search(r"[a-z]{2}", full[4:])
    assert found, f"no stop string to pick from {full!r}"
    stop = found.group()
    kwargs: dict[str, Any] = dict(model="target", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == full[: full.index(stop)] and reason == "stop"


def test_seed_gives_the_same_sample_streaming_or_not(client: Any) -> None:
    kwargs: dict[str, Any] = dict(model="target", prompt="class ", max_tokens=20, temperature=1.0, seed=11)
    plain = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    other = client.completions.create(**{**kwargs, "seed": 12}).choices[0].text
    assert plain == streamed and plain != other


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_stats(client: Any, kind: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    common: dict[str, Any] = dict(model="target", max_tokens=10, temperature=0, stream=True, stream_options=options)
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "x = ["}], **common))
    else:
        chunks = list(client.completions.create(prompt="x = [", **common))
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == chunks[-1].usage.completion_tokens > 0
    assert (done[0] == 0) == (kind == "chat")  # only chat has a role chunk before any token
    assert not chunks[-1].choices  # the include_usage chunk still ends the stream
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


PENALTIES = {
    "frequency+presence": SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.8),
    "negative+bias": SamplingParams(temperature=0.0, frequency_penalty=-0.5, logit_bias={17: 3.0, 42: -100.0}),
}


def penalty_body(params: SamplingParams) -> dict[str, Any]:
    return {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
            "logit_bias": {str(k): v for k, v in params.logit_bias.items()}}


def ws_ids(stack: Stack, body: dict[str, Any]) -> list[int]:
    from websockets.sync.client import connect

    ids: list[int] = []
    with connect(stack.ws_url, max_size=None) as ws:
        ws.send(json.dumps(body))
        while (frame := json.loads(ws.recv()))["type"] == "token":
            ids += frame["token_ids"]
    assert frame["type"] == "done", frame
    return ids


@pytest.mark.parametrize("name", list(PENALTIES))
def test_greedy_with_penalties_equals_transformers(stack: Stack, target: LoadedModel, name: str) -> None:
    params = PENALTIES[name]
    for prompt in PROMPTS:
        ids = list(target.tokenizer(prompt)["input_ids"])
        want = greedy_with_penalties(target.model, ids, 40, params, target.eos_ids)
        got = ws_ids(stack, {"kind": "completion", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                             **penalty_body(params)})
        assert got == want, f"{name} {prompt!r}"
        assert got != greedy_reference(target.model, ids, 40, target.eos_ids)  # the penalties mattered


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_through_the_sdk(client: Any, target: LoadedModel, stream: bool) -> None:
    params = PENALTIES["frequency+presence"]
    prompt = "while True:\n    "
    messages = [{"role": "user", "content": prompt}]
    want = greedy_with_penalties(target.model, chat_ids(target, prompt), 24, params, target.eos_ids)
    kwargs: dict[str, Any] = dict(model="target", messages=messages, max_tokens=24, temperature=0,
                                  frequency_penalty=1.5, presence_penalty=0.5)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text == target.tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.stat
def test_sampling_with_penalties_is_lossless(stack: Stack, target: LoadedModel) -> None:
    """Chi-square of the first two tokens against the transformers reference with the same penalties.

    The bias moves the first token's law (down on the target's favourite, up on its third); the
    negative frequency/presence penalties make the second token repeat the first far more often,
    which only happens if the second position counts the first as generated. The control: the
    same samples are rejected against the law with the bias alone. Retried once with fresh
    seeds, as run_sampling.
    """
    prompt = "def "
    prompt_ids = list(target.tokenizer(prompt)["input_ids"])
    favourites = first_two_with_penalties(target.model, prompt_ids, SamplingParams(temperature=0.6)).sum(1).topk(3)
    bias = {int(favourites.indices[0]): -2.0, int(favourites.indices[2]): 1.5}
    params = SamplingParams(temperature=0.6, frequency_penalty=-2.0, presence_penalty=-1.0, repetition_penalty=1.3,
                            logit_bias=bias, ignore_eos=True)
    body = {"kind": "completion", "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0.6,
            **penalty_body(params)}
    joint = first_two_with_penalties(target.model, prompt_ids, params)
    bias_only = first_two_with_penalties(target.model, prompt_ids, SamplingParams(temperature=0.6, logit_bias=bias))
    for attempt in range(2):
        seeds = range(attempt * SAMPLES, (attempt + 1) * SAMPLES)
        results = asyncio.run(stream_many(stack, [{**body, "seed": seed} for seed in seeds]))
        samples = [(ids[0], ids[1]) for ids, _, _ in results]
        p_values = lossless_p_values(samples, joint)
        print(f"attempt {attempt}: {p_values}")
        if min(p_values.values()) > 0.01:
            break
    assert min(p_values.values()) > 0.01, p_values
    assert min(lossless_p_values(samples, bias_only).values()) < 1e-6  # the test tells the penalties apart


def test_n_choices_are_independent_seeded_sessions(client: Any) -> None:
    kwargs: dict[str, Any] = dict(model="target", prompt="class ", max_tokens=12, temperature=1.0)
    out = client.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=7 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == alone  # choice i is the request with seed + i
    assert len(set(alone)) == 3
    one = client.completions.create(seed=7, **kwargs).usage
    assert out.usage.prompt_tokens == one.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 36


def test_n_choices_compute_the_prompt_once(client: Any, stack: Stack) -> None:
    """n = 4 greedy choices of a long prompt: identical texts, and the verifier copied the
    prompt's KV rows between the sessions instead of prefilling it four times."""

    def shared() -> float:
        text = httpx.get(stack.verifier_url + "/metrics").text
        found = re.search(r"^specfleet_verifier_shared_prefix_tokens_total (\S+)$", text, re.M)
        assert found, "the verifier exports no shared-prefix counter"
        return float(found.group(1))

    before = shared()
    out = client.completions.create(model="target", prompt="def fibonacci(n):\n" * 12, n=4, max_tokens=8,
                                    temperature=0)
    assert out.usage.prompt_tokens > 40
    assert len({c.text for c in out.choices}) == 1
    assert shared() - before >= 3 * 16


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n_streaming_equals_not_streaming(client: Any, kind: str) -> None:
    common: dict[str, Any] = dict(model="target", max_tokens=10, temperature=0.9, seed=3, n=2, logprobs=True)
    if kind == "chat":
        create, common["messages"] = client.chat.completions.create, [{"role": "user", "content": "x = ["}]
    else:
        create, common["prompt"], common["logprobs"] = client.completions.create, "x = [", 1

    def text(c: Any) -> str:
        return (c.message.content if kind == "chat" else c.text) or ""

    def piece(c: Any) -> str:
        return (c.delta.content if kind == "chat" else c.text) or ""

    plain = create(**common)
    streamed = ["", ""]
    reasons: list[str | None] = [None, None]
    logprobs: list[int] = [0, 0]
    for chunk in create(stream=True, stream_options={"include_usage": True}, **common):
        for c in chunk.choices:
            streamed[c.index] += piece(c)
            reasons[c.index] = c.finish_reason or reasons[c.index]
            if c.logprobs is not None:
                logprobs[c.index] += len(c.logprobs.content if kind == "chat" else c.logprobs.tokens)
        if not chunk.choices:
            assert chunk.usage.completion_tokens == plain.usage.completion_tokens
    assert streamed == [text(c) for c in plain.choices] and streamed[0] != streamed[1]
    assert reasons == [c.finish_reason for c in plain.choices]
    assert sum(logprobs) == plain.usage.completion_tokens


def test_websocket_refuses_n(stack: Stack) -> None:
    from websockets.sync.client import connect

    with connect(stack.ws_url) as ws:
        ws.send(json.dumps({"kind": "completion", "prompt": "a", "n": 2}))
        frame = json.loads(ws.recv())
    assert frame["type"] == "error" and frame["error"]["param"] == "n"
