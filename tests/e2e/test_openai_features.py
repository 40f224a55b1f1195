"""OpenAI request features through the official ``openai`` client against the real fleet.

Logprobs: for greedy requests the output stays token-identical to target-only greedy decoding,
and each token's logprob (and top-1) equals the target's log-softmax computed by transformers
over the whole sequence, within 1e-4; streaming and not, chat and completions. Processed
logprobs of a sampled request equal the log of the distribution sampled from.
"""

from __future__ import annotations

import json
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
