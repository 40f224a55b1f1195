"""No request field is silently ignored: each refused field gets a 400 naming it, neutral values
and accepted fields pass, unknown fields are refused, and the README's table lists every field.

No verifier runs: a request that passes validation gets 503 (verifier down), which is how these
tests tell "accepted" from "refused" without generating anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from services.coordinator.app import create_app
from services.coordinator.config import CoordinatorConfig
from services.coordinator.fields import FIELDS, STREAM_OPTIONS
from services.coordinator.model_info import ModelInfo
from shared.config import from_flags
from shared.queue_memory import MemoryQueue

DOWN_URL = "ws://127.0.0.1:1/v1/frontend"
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
README = Path(__file__).resolve().parents[2] / "services" / "coordinator" / "README.md"

#: a value asking for something of every refused field (the test fails if a refused field lacks one)
ASKING: dict[str, Any] = {
    "store": True, "service_tier": "flex",
    "prompt_logprobs": 1,
    "best_of": 2, "guided_grammar": "root ::= 'a'",
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "structured_outputs": {"regex": "a"}, "structural_tag": "{}", "min_p": 0.1, "min_tokens": 3,
    "include_stop_str_in_output": True, "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "truncate_prompt_tokens": 5,
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "suffix": "end", "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "use_beam_search": True,
    "length_penalty": 0.5, "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
    "documents": [{"text": "x"}], "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1}, "logits_processors": ["x"], "priority": 1, "request_id": "mine",
    "cache_salt": "s", "kv_transfer_params": {}, "vllm_xargs": {"a": 1},
}
#: neutral values of refused fields: they ask for nothing, and stock clients send them
NEUTRAL: list[tuple[str, Any]] = [
    ("tools", []),
    ("tool_choice", "none"), ("store", False), ("service_tier", "auto"),
    ("best_of", 1), ("min_p", 0.0), ("skip_special_tokens", True), ("use_beam_search", False),
]


def base(kind: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}


def refused_cases() -> list[tuple[str, str]]:
    return [(name, kind) for name, f in FIELDS.items() if f.status == "refused" for kind in f.kinds]


@pytest.fixture(scope="module")
def client(tiny_models: dict[str, Path]) -> Iterator[TestClient]:
    model = ModelInfo.load(str(tiny_models["target"]))
    config = from_flags(CoordinatorConfig, model=model.root, verifier_url=DOWN_URL, node_id="coord-fields-test")
    with TestClient(create_app(config, queue=MemoryQueue(), model=model)) as c:
        yield c


def test_every_refused_field_has_a_value_to_ask_with() -> None:
    assert {name for name, _ in refused_cases()} == set(ASKING)


@pytest.mark.parametrize(("name", "kind"), refused_cases(), ids=[f"{n}-{k}" for n, k in refused_cases()])
def test_refused_field_is_a_400_naming_it(client: TestClient, name: str, kind: str) -> None:
    body = {**base(kind), name: ASKING[name]}
    resp = client.post(PATHS[kind], json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_parameter"
    assert name in err["message"] and "README" in err["message"]


@pytest.mark.parametrize(("name", "value"), NEUTRAL, ids=[f"{n}={v}" for n, v in NEUTRAL])
def test_neutral_values_pass(client: TestClient, name: str, value: Any) -> None:
    kind = FIELDS[name].kinds[0]
    resp = client.post(PATHS[kind], json={**base(kind), name: value})
    assert resp.status_code == 503, resp.text  # passed validation; no verifier to run it


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_accepted_fields_pass(client: TestClient, kind: str) -> None:
    accepted = {n: "x" for n, f in FIELDS.items() if f.status == "accepted" and kind in f.kinds}
    if kind == "chat":
        accepted.update(metadata={"k": "v"}, parallel_tool_calls=True)
    resp = client.post(PATHS[kind], json={**base(kind), **accepted})
    assert resp.status_code == 503, resp.text


@pytest.mark.parametrize(("kind", "name"), [("chat", "frobnicate"), ("completion", "messages"), ("chat", "prompt"),
                                            ("chat", "best_of"), ("completion", "tools")])
def test_unknown_or_other_endpoint_fields_are_refused(client: TestClient, kind: str, name: str) -> None:
    resp = client.post(PATHS[kind], json={**base(kind), name: 1})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == name and "Unrecognized request argument" in err["message"]


def test_stream_options_fields(client: TestClient) -> None:
    body = {**base("completion"), "stream": True, "stream_options": {"include_usage": True, "surprise": 1}}
    assert client.post(PATHS["completion"], json=body).json()["error"]["param"] == "stream_options.surprise"


def test_websocket_refuses_a_field_by_name(client: TestClient) -> None:
    with client.websocket_connect("/v1/stream") as ws:
        ws.send_json({"kind": "chat", **base("chat"), "best_of": 2})
        frame = ws.receive_json()
    assert frame["type"] == "error" and frame["error"]["param"] == "best_of", frame


def test_readme_table_lists_every_field_with_its_status() -> None:
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| ([a-z]+)", README.read_text(), re.M))
    expected = {n: f.status for n, f in FIELDS.items()}
    expected.update({f"stream_options.{n}": f.status for n, f in STREAM_OPTIONS.items()})
    assert rows == expected
