"""Greedy SSE completions for the fault tests: the request, its streamed text, the check against
target-only decoding, and the verifier's open-session gauge."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from shared.models import LoadedModel
from tests.conftest import greedy_reference
from tests.e2e.test_full_stack import prompt_ids


def greedy_body(tag: str, i: int, max_tokens: int, prompt: str = "def {tag}{i}(x") -> dict[str, Any]:
    return {"model": "target", "prompt": prompt.format(tag=tag, i=i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def stream_text(http: httpx.AsyncClient, req: dict[str, Any], seen: list[int] | None = None) -> str:
    """The text of one streamed completion; ``seen[0]`` counts its text chunks as they arrive."""
    text = ""
    async with http.stream("POST", "/v1/completions", json=req) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                if seen is not None:
                    seen[0] += 1
    return text


def check_greedy(target: LoadedModel, bodies: list[dict[str, Any]], texts: list[str]) -> None:
    """Each text is target-only greedy decoding of its request."""
    for i, (req, text) in enumerate(zip(bodies, texts, strict=True)):
        ids = prompt_ids(target, {"kind": "completion", **req})
        ref = greedy_reference(target.model, ids, req["max_tokens"], set())
        assert text == target.tokenizer.decode(ref, skip_special_tokens=True), f"request {i}: {req['prompt']!r}"


def metric_value(metrics_text: str, name: str) -> float:
    """One unlabelled sample ``name`` from a /metrics page's text (0 when absent)."""
    found = re.search(rf"^{name} (\S+)$", metrics_text, re.M)
    return float(found.group(1)) if found else 0.0


def sample_metric(url: str, name: str, timeout_s: float = 5.0) -> float:
    """One unlabelled sample from a service's /metrics at ``url`` (0 when unreachable or absent)."""
    try:
        return metric_value(httpx.get(url, timeout=timeout_s).text, name)
    except httpx.HTTPError:
        return 0.0


async def sample_metric_async(http: httpx.AsyncClient, url: str, name: str) -> float:
    """:func:`sample_metric` without blocking the event loop that clients stream on."""
    try:
        return metric_value((await http.get(url)).text, name)
    except httpx.HTTPError:
        return 0.0
