"""The real run: images built on a local base, the rendered ci overlay played by podman, then REST,
SSE and WebSocket requests against the pods, greedy output token-identical to the target alone.

podman is required: if it is missing or broken this fails (run scripts/ensure-k8s-tools.sh).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from shared.model_import import DEFAULT_MODEL, fetch_model
from shared.models import LoadedModel, load_model
from tests.conftest import invariant_greedy
from tests.k8s.manifests import K8S, ROOT, runner

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(1200)]

PROMPTS = ["def parse(", "What is the capital of France?", "The water cycle is", "Name three birds."]
MAX_TOKENS = 16


class Fleet:
    def __init__(self, ips: dict[str, str], api_key: str) -> None:
        self.ips = ips
        self.base = f"http://{ips['coordinator']}:8000"
        self.ws_url = f"ws://{ips['coordinator']}:8000/v1/stream"
        self.headers = {"Authorization": f"Bearer {api_key}"}


def _secret(key: str) -> str:
    for line in (K8S / "overlays" / "ci" / "secrets.env").read_text().splitlines():
        name, _, value = line.partition("=")
        if name == key:
            return value
    raise AssertionError(f"{key} missing from the ci overlay's secrets.env")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    play = runner()
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: the k8s tier needs it (run scripts/ensure-k8s-tools.sh)")
    started = time.monotonic()
    try:
        ips = play.up(timeout_s=300)
    except play.PlayError as exc:
        play.down(quiet=True)
        pytest.fail(f"the ci overlay did not come up under podman: {exc}")
    print(f"\nci overlay up under podman in {time.monotonic() - started:.0f} s: {ips}")
    yield Fleet(ips, _secret("api-key"))
    play.down(quiet=True)
    left = subprocess.run(["podman", "pod", "ps", "--format", "{{.Name}}"], capture_output=True, text=True).stdout
    assert not {f"{n}-pod-0" for n in ips} & set(left.split()), f"pods left after teardown: {left}"


@pytest.fixture(scope="module")
def target(fleet: Fleet) -> LoadedModel:
    """The model the images bake in, in the dtype and on the matmul kernel the verifier pod runs it
    (its /status), which the references here run too: an image without g++ has no row-wise kernel, in
    bfloat16 another kernel's roundings flip some near-tied tokens, and where oneDNN's bfloat16 is not
    batch-invariant (a Xeon VM that lists AMX) the pod runs float32."""
    status = httpx.get(f"http://{fleet.ips['verifier']}:8100/status", timeout=10).json()
    _POD["matmul"] = str(status.get("matmul") or "auto")
    return load_model(fetch_model(DEFAULT_MODEL, ROOT / ".specfleet"), dtype=str(status.get("dtype") or "auto"))


_POD: dict[str, str] = {"matmul": "auto"}
_REFERENCES: dict[tuple[str, str, str, bool], list[int]] = {}


def reference(target: LoadedModel, prompt: str, chat: bool) -> list[int]:
    """Target-only greedy ids, computed once per prompt (in this process, beside the pods, on the
    verifier pod's matmul kernel)."""
    key = (target.name, _POD["matmul"], prompt, chat)
    if key not in _REFERENCES:
        _REFERENCES[key] = _greedy(target, prompt, chat)
    return _REFERENCES[key]


def _greedy(target: LoadedModel, prompt: str, chat: bool) -> list[int]:
    tok = target.tokenizer
    if chat:
        out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    else:
        ids = list(tok(prompt)["input_ids"])
    return invariant_greedy(target, ids, MAX_TOKENS, matmul=_POD["matmul"])


def text_of(target: LoadedModel, ids: list[int]) -> str:
    return str(target.tokenizer.decode(ids, skip_special_tokens=True))


def test_pods_answer_their_probes(fleet: Fleet) -> None:
    ips = fleet.ips
    assert httpx.get(f"http://{ips['verifier']}:8100/health").status_code == 200
    drafter = httpx.get(f"http://{ips['drafter']}:9100/ready")
    assert drafter.status_code == 200 and drafter.json()["verifier_connected"] is True
    assert "specfleet_drafter_rounds" in httpx.get(f"http://{ips['drafter']}:9100/metrics").text
    ready = httpx.get(fleet.base + "/ready").json()
    assert ready["verifier_connected"] is True and len(ready["drafters"]) == 1
    redis = subprocess.run(["podman", "exec", "redis-pod-0-redis", "redis-cli", "config", "get", "appendonly"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert redis == ["appendonly", "yes"]


def test_api_key_is_required(fleet: Fleet) -> None:
    r = httpx.post(fleet.base + "/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 401


def test_rest_greedy_identical(fleet: Fleet, target: LoadedModel) -> None:
    for i, prompt in enumerate(PROMPTS):
        chat = i % 2 == 1
        ref = reference(target, prompt, chat)
        if chat:
            body: dict[str, Any] = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": MAX_TOKENS, "temperature": 0}
            r = httpx.post(fleet.base + "/v1/chat/completions", json=body, headers=fleet.headers, timeout=120)
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"]
        else:
            body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = httpx.post(fleet.base + "/v1/completions", json=body, headers=fleet.headers, timeout=120)
            r.raise_for_status()
            text = r.json()["choices"][0]["text"]
        assert text == text_of(target, ref), f"REST output differs from target-only for {prompt!r}"
        assert r.json()["usage"]["completion_tokens"] == len(ref)


def test_sse_greedy_identical(fleet: Fleet, target: LoadedModel) -> None:
    for prompt in PROMPTS[1::2]:  # the chat ones
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True}
        pieces: list[str] = []
        done = False
        with httpx.stream("POST", fleet.base + "/v1/chat/completions", json=body, headers=fleet.headers,
                          timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[len("data: "):])
                pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
        assert done
        assert "".join(pieces) == text_of(target, reference(target, prompt, chat=True))


async def _ws_one(fleet: Fleet, body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    async with websockets.connect(fleet.ws_url, additional_headers=fleet.headers, max_size=None) as ws:
        await ws.send(json.dumps(body))
        ids: list[int] = []
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if frame["type"] == "token":
                ids += frame["token_ids"]
            elif frame["type"] == "done":
                return ids, frame
            else:
                raise AssertionError(f"unexpected frame {frame}")


def test_websocket_greedy_identical_concurrent(fleet: Fleet, target: LoadedModel) -> None:
    bodies = [{"kind": "completion", "model": DEFAULT_MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
              for p in PROMPTS]

    async def all_at_once() -> list[tuple[list[int], dict[str, Any]]]:
        return list(await asyncio.gather(*[_ws_one(fleet, b) for b in bodies]))

    for prompt, (ids, done) in zip(PROMPTS, asyncio.run(all_at_once()), strict=True):
        ref = reference(target, prompt, chat=False)
        assert ids == ref, f"WebSocket tokens differ from target-only for {prompt!r}"
        assert done["usage"]["completion_tokens"] == len(ref)


def _redis(*args: str) -> str:
    return subprocess.run(["podman", "exec", "redis-pod-0-redis", "redis-cli", *args], capture_output=True,
                          text=True, check=True).stdout.strip()


def _diagnosis() -> str:
    play = runner()
    state = play.run(["podman", "pod", "ps", "--format", "{{.Name}} {{.Status}}"], check=False)
    queue = play.run(["podman", "exec", "redis-pod-0-redis", "redis-cli", "XINFO", "GROUPS", "specfleet:requests"],
                     check=False)
    return (f"pods:\n{state}\nredis groups:\n{queue}\ndrafter log:\n{play.logs('drafter', 'drafter')}\n"
            f"coordinator log:\n{play.logs('coordinator', 'coordinator')}\n"
            f"verifier log:\n{play.logs('verifier', 'verifier', lines=60)}")


def test_queued_request_survives_a_redis_restart(fleet: Fleet, target: LoadedModel) -> None:
    """With no drafter, a request waits in the Redis stream (the ci overlay runs the coordinator with
    speculation on); Redis restarts (AOF on its volume); the drafter comes back, takes the request and
    the answer is still the target's own."""
    subprocess.run(["podman", "pod", "stop", "-t", "10", "drafter-pod-0"], check=True, capture_output=True)
    prompt = PROMPTS[0]
    result: dict[str, Any] = {}

    def send() -> None:
        body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        try:
            result["r"] = httpx.post(fleet.base + "/v1/completions", json=body, headers=fleet.headers, timeout=300)
        except httpx.HTTPError as exc:  # reported by the assertions below, not as a thread's traceback
            result["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 30
    while (length := _redis("XLEN", "specfleet:requests")) != "1":
        assert time.monotonic() < deadline, (f"the request never reached the Redis stream (XLEN {length}, "
                                             f"the sender's result {result!r}); {_diagnosis()}")
        time.sleep(0.5)
    time.sleep(1.5)  # appendfsync everysec
    # Stop, then start (`podman pod restart` races with the pod's exit policy and can stop it again).
    subprocess.run(["podman", "pod", "stop", "-t", "10", "redis-pod-0"], check=True, capture_output=True)
    subprocess.run(["podman", "pod", "start", "redis-pod-0"], check=True, capture_output=True)
    deadline = time.monotonic() + 90  # it took over 30 s once, in a full test run on 2 cores
    nudge = time.monotonic() + 10
    while True:
        try:
            if _redis("PING") == "PONG":
                break
        except subprocess.CalledProcessError:  # not running (yet): the pod's exit policy may have stopped it
            if time.monotonic() > nudge:  # again; starting a running pod does nothing
                subprocess.run(["podman", "pod", "start", "redis-pod-0"], check=False, capture_output=True)
                nudge = time.monotonic() + 10
        assert time.monotonic() < deadline, f"redis did not come back\n{_diagnosis()}"
        time.sleep(0.5)
    assert _redis("XLEN", "specfleet:requests") == "1", "the queued request did not survive the restart"
    subprocess.run(["podman", "pod", "start", "drafter-pod-0"], check=True, capture_output=True)
    sender.join(280)
    assert not sender.is_alive(), f"the queued request was never answered; {_diagnosis()}"
    assert "r" in result, f"the queued request failed: {result.get('error')!r}; {_diagnosis()}"
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text_of(target, reference(target, prompt, chat=False))
