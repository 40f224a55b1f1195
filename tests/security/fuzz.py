"""Fuzzed inputs for every endpoint: binary MessagePack frames, JSON text frames, REST bodies.

Each generator is seeded and yields (category, payload). Categories cover random bytes, bit
flips and truncations of valid frames, wrong field types and out-of-range values, unknown
message types, deep nesting, oversize frames, text where binary is expected, and valid frames
sent in the wrong order or for another peer's session.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import msgspec

from shared.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Batch,
    Cancel,
    CloseSession,
    Draft,
    FleetStatus,
    Hello,
    Message,
    OpenSession,
    QueueAck,
    QueueDelivery,
    QueuedRequest,
    QueuePull,
    QueueRoom,
    SamplingParams,
    SessionOpened,
    TokenEvent,
    Verdict,
    Welcome,
    encode,
)

WEIRD_VALUES: list[Any] = [
    None, True, -1, 0, 2**31, 2**63 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 300, b"\x00\xff",
    [], [None], [-5], [2**40], {}, {"a": 1}, [[[]]], "\u0000",
]
MSG_TYPES = ["hello", "welcome", "refused", "open_session", "session_opened", "draft", "verdict", "close_session",
             "cancel", "error", "token_event", "fleet_status", "queue_pull", "queue_delivery", "queue_ack", "batch",
             "queued_request", "nope", ""]
FIELDS = ["request_id", "round", "token_ids", "q", "prompt_ids", "params", "origin", "speculative", "role", "node_id",
          "protocol_version", "max_items", "delivery_id", "items", "confidence", "max_tokens", "temperature"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


def valid_frames(victim: str, fingerprint: str = "") -> list[Message]:
    """Well-formed messages of every kind: on any given link most are in the wrong place or order,
    and those naming ``victim`` target another peer's session."""
    return [
        Hello(role="drafter", node_id="fuzz", protocol_version=PROTOCOL_VERSION, tokenizer_fingerprint=fingerprint),
        Hello(role="frontend", node_id="fuzz", protocol_version=PROTOCOL_VERSION + 1),
        Welcome(node_id="v", protocol_version=PROTOCOL_VERSION, target_model="t", tokenizer_fingerprint="f",
                max_model_len=1, max_draft_tokens=1),
        Draft(request_id=victim, round=0, token_ids=[5, 6, 7]),
        Draft(request_id=victim, round=99, token_ids=[]),
        Draft(request_id="never-opened", round=0, token_ids=[1]),
        CloseSession(request_id=victim),
        Cancel(request_id=victim),
        Cancel(request_id="never-opened"),
        OpenSession(request_id=victim, prompt_ids=[3, 4], params=PARAMS, origin="fuzz"),
        OpenSession(request_id="fz-bad-vocab", prompt_ids=[2**31 - 1], params=PARAMS, origin="fuzz"),
        OpenSession(request_id="fz-huge", prompt_ids=[3], params=SamplingParams(max_tokens=10**9), origin="fuzz"),
        SessionOpened(request_id=victim, draft_budget=3),
        Verdict(request_id=victim, round=0, accepted=1, token_ids=[1], finished=True, finish_reason="stop",
                draft_budget=0),
        TokenEvent(request_id=victim, origin="fuzz", token_ids=[1], text="x", finished=True),
        FleetStatus(drafters=["x"], sessions=1, target_model="t"),
        QueuePull(max_items=1024),
        QueuePull(max_items=1, room=100_000),
        QueueRoom(room=0),
        QueueAck(delivery_id="1"),
        QueueAck(delivery_id="x" * 100),
        QueueDelivery(delivery_id="1", request=QueuedRequest(request_id="q", prompt_ids=[1], params=PARAMS,
                                                             origin="o", model="m", created_at=0.0)),
        Batch(items=[Draft(request_id=victim, round=0, token_ids=[1]), CloseSession(request_id=victim),
                     Cancel(request_id=victim)]),
    ]


def deep(depth: int) -> bytes:
    """A MessagePack array nested ``depth`` deep (each level: a 1-element fixarray)."""
    return b"\x91" * depth + b"\xc0"


def msgpack_frames(seed: int, n: int, victim: str, fingerprint: str = "") -> Iterator[tuple[str, bytes | str]]:
    """``n`` fuzzed frames for a MessagePack WebSocket endpoint (oversize ones are not included:
    a server closes the link on those, so callers send them separately with ``oversize``)."""
    rng = random.Random(seed)
    valid = [encode(m) for m in valid_frames(victim, fingerprint)]
    for i in range(n):
        kind = i % 10
        if kind == 0:
            yield "random", rng.randbytes(rng.randrange(0, 200))
        elif kind == 1:
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 5)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            yield "bitflip", bytes(frame)
        elif kind == 2:
            frame = rng.choice(valid)
            yield "truncated", frame[: rng.randrange(len(frame))]
        elif kind == 3:
            body: dict[str, Any] = {"type": rng.choice(MSG_TYPES)}
            for name in rng.sample(FIELDS, rng.randrange(0, 6)):
                body[name] = rng.choice(WEIRD_VALUES)
            yield "wrong_types", msgspec.msgpack.encode(body)
        elif kind == 4:
            yield "deep", deep(rng.choice([64, 1000, 10_000, 100_000]))
        elif kind == 5:
            yield "not_a_map", msgspec.msgpack.encode(rng.choice([1, "hello", [1, 2], None, 2.5, b"raw"]))
        elif kind == 6:
            yield "text", rng.choice(["", "hello", '{"type": "draft"}', "\u00ff" * 50])
        elif kind == 7:
            items = [{"type": "draft", "request_id": victim, "round": rng.randrange(-3, 3),
                      "token_ids": [rng.randrange(-1, 2**32)]} for _ in range(rng.randrange(1, 8))]
            yield "bad_batch", msgspec.msgpack.encode({"type": "batch", "items": items})
        else:
            yield "valid_out_of_place", rng.choice(valid)


def oversize() -> bytes:
    """A frame just past the protocol's limit: servers must refuse it without harm."""
    return b"\xc6" + (MAX_FRAME_BYTES + 16).to_bytes(4, "big") + b"\x00" * (MAX_FRAME_BYTES + 16)


def json_bodies(seed: int, n: int) -> Iterator[tuple[str, bytes]]:
    """``n`` request bodies every one of which is invalid for the OpenAI endpoints."""
    rng = random.Random(seed)
    good_chat: dict[str, Any] = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad_values: dict[str, list[Any]] = {
        "messages": [None, 1, "hi", [], [1], [{"role": "wizard", "content": "x"}], [{"content": "x"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "nope"}]}]],
        "max_tokens": [-1, 0, "x", 1.5, [], {}, 10**30, True],
        "temperature": [-1, "hot", [], {}, 1e9],
        "top_p": [0, -0.5, 2, "x"],
        "top_k": [-2, "x", 1.5],
        "n": [0, -1, "x", 5],
        "stop": [5, [1, 2], {"a": 1}, ["x"] * 100],
        "model": [5, [], {}, "no-such-model"],
        "seed": ["x", 1.5, []],
        "stream": ["yes", 5, []],
        "prompt": [None, 5, {}, [[-1]], [{"a": 1}]],
    }
    never_valid: list[Any] = [None, 1, "hi", [], [1], [{"role": "wizard", "content": "x"}], [{"content": "x"}]]
    for i in range(n):
        kind = i % 6
        if kind == 0:
            yield "random", rng.randbytes(rng.randrange(0, 100))
        elif kind == 1:
            text = json.dumps(good_chat)
            yield "truncated", text[: rng.randrange(1, len(text) - 1)].encode()
        elif kind == 2:
            body = dict(good_chat)
            for name in rng.sample(sorted(bad_values), rng.randrange(1, 4)):
                body[name] = rng.choice(bad_values[name])
            body["messages"] = rng.choice(never_valid)  # whatever else was drawn, this alone is a 4xx
            yield "wrong_types", json.dumps(body).encode()
        elif kind == 3:
            depth = rng.choice([100, 10_000, 200_000])
            yield "deep", ("[" * depth + "]" * depth).encode() if rng.random() < 0.5 else \
                ('{"messages": ' + "[" * depth + "]" * depth + "}").encode()
        elif kind == 4:
            yield "not_an_object", json.dumps(rng.choice([1, "x", [good_chat], None, True])).encode()
        else:
            yield "bad_utf8", b'{"messages": "\xff\xfe"}' + rng.randbytes(rng.randrange(0, 10))
