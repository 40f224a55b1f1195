"""OpenAI request features through the official ``openai`` client against the real fleet.

Logprobs: for greedy requests the output stays token-identical to target-only greedy decoding,
and each token's logprob (and top-1) equals the target's log-softmax computed by transformers
over the whole sequence, within 1e-4; streaming and not, chat and completions. Processed
logprobs of a sampled request equal the log of the distribution sampled from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.models import LoadedModel, load_model
from shared.protocol import SamplingParams
from shared.sampling import probs_from_logits
from tests.conftest import greedy_reference
from tests.e2e.stack import Stack, StackSpec, run_stack

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
