"""The wire protocol: every message round-trips, and decode refuses anything else with ProtocolError.

The fuzz tests are the contract that a hostile or buggy peer can never crash a service's
read loop: decode returns a message or raises ProtocolError, nothing else.
"""

from __future__ import annotations

import random
import typing

import msgpack
import msgspec
import pytest
import torch

from shared import protocol as P
from shared.draft_q import pack

PARAMS = P.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=7, max_tokens=32, stop=["\n\n"],
                          stop_token_ids=[3], ignore_eos=True)
QREQ = P.QueuedRequest(request_id="r1", prompt_ids=[1, 2, 3], params=PARAMS, origin="coord-1", model="target",
                       created_at=1700000000.5)

SAMPLES: list[P.Message] = [
    QREQ,
    P.Hello(role="drafter", node_id="drafter-1", protocol_version=P.PROTOCOL_VERSION,
            tokenizer_fingerprint="abcd", model="draft-L1", max_sessions=4, site="edge-box"),
    P.Welcome(node_id="verifier", protocol_version=P.PROTOCOL_VERSION, target_model="target",
              tokenizer_fingerprint="abcd", max_model_len=512, max_draft_tokens=16, instance="0123abcd"),
    P.Refused(code="bad_version", message="peer speaks version 2, we speak 1"),
    P.OpenSession(request_id="r1", prompt_ids=[5, 6], params=P.SamplingParams(), origin="coord-1",
                  speculative=False, waited_s=0.25),
    P.OpenSession(request_id="r2", prompt_ids=[5, 6], params=P.SamplingParams(), origin="coord-1",
                  speculative=False, resume=P.ResumeState(generated_ids=[7, 8], released_chars=3, drafted_tokens=4,
                                                          accepted_tokens=2)),
    P.ResumeDone(sessions=1),
    P.SessionOpened(request_id="r1", draft_budget=4),
    P.Draft(request_id="r1", round=3, token_ids=[9, 10],
            q=[pack(torch.tensor([9, 11]), torch.tensor([0.75, 0.25]).half()),
               pack(torch.tensor([10]), torch.tensor([1.0]).half())]),
    P.Verdict(request_id="r1", round=3, accepted=1, token_ids=[9, 12], finished=True, finish_reason="stop",
              draft_budget=0),
    P.CloseSession(request_id="r1", reason="done"),
    P.Cancel(request_id="r1"),
    P.Release(request_id="r1"),
    P.Adopt(request_id="r1"),
    P.Adopted(request_id="r1", state="live", first_seq=1, last_seq=7),
    P.ErrorFrame(code="bad_draft", message="q sums to 0.5", request_id="r1"),
    P.TokenEvent(request_id="r1", origin="coord-1", token_ids=[9, 12], text="hi", finished=True,
                 finish_reason="length", prompt_tokens=2, completion_tokens=2, drafted_tokens=4,
                 accepted_tokens=1, seq=3),
    P.FleetStatus(drafters=["drafter-1"], sessions=3, target_model="target"),
    P.QueuePull(max_items=8),
    P.QueuePull(max_items=1, room=3),
    P.QueueRoom(room=4),
    P.QueueDelivery(delivery_id="1-0", request=QREQ),
    P.QueueAck(delivery_id="1-0"),
    P.Batch(items=[P.Verdict(request_id="r1", round=0, accepted=0, token_ids=[4], finished=False, finish_reason=None,
                             draft_budget=4),
                   P.ErrorFrame(code="busy", message="retry", request_id="r2")]),
]


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(P.Message))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    data = P.encode(msg)
    assert isinstance(data, bytes)
    assert P.decode(data) == msg
    assert P.decode(bytearray(data)) == msg
    assert P.decode(memoryview(data)) == msg


def test_ids_only_draft_round_trips_with_q_none() -> None:
    msg = P.Draft(request_id="r", round=0, token_ids=[])
    assert P.decode(P.encode(msg)) == msg


def _raw(msg: P.Message) -> dict[str, typing.Any]:
    return typing.cast(dict[str, typing.Any], msgpack.unpackb(P.encode(msg)))


def _pack(obj: object) -> bytes:
    return typing.cast(bytes, msgpack.packb(obj))


def test_oversized_frame_refused() -> None:
    data = P.encode(P.QueuedRequest(request_id="r", prompt_ids=[1] * 1000, params=PARAMS, origin="o",
                                    model="m", created_at=0.0))
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.decode(data, max_bytes=len(data) - 1)
    assert P.decode(data, max_bytes=len(data)).request_id == "r"  # type: ignore[union-attr]


def test_default_limit_refuses_a_frame_over_max_frame_bytes() -> None:
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.decode(b"\x00" * (P.MAX_FRAME_BYTES + 1))


def test_text_frame_refused() -> None:
    with pytest.raises(P.ProtocolError, match="text frame"):
        P.decode('{"type": "cancel", "request_id": "r"}')  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: d.update(prompt_ids=[1, -2]), "negative token id"),
        (lambda d: d.update(prompt_ids=[2**31]), "token id beyond int32"),
        (lambda d: d.update(prompt_ids=[]), "empty prompt"),
        (lambda d: d.update(surprise=1), "unknown field"),
        (lambda d: d.update(request_id=5), "wrong type: int for str"),
        (lambda d: d.update(prompt_ids="abc"), "wrong type: str for list"),
        (lambda d: d.update(created_at="now"), "wrong type: str for float"),
        (lambda d: d.update(type="no_such_message"), "unknown tag"),
        (lambda d: d.pop("type"), "missing tag"),
        (lambda d: d.pop("request_id"), "missing required field"),
        (lambda d: d.update(request_id=""), "empty request id"),
        (lambda d: d.update(request_id="x" * 129), "request id too long"),
        (lambda d: d["params"].update(temperature=-1.0), "negative temperature"),
        (lambda d: d["params"].update(top_p=0.0), "top_p of zero"),
        (lambda d: d["params"].update(max_tokens=0), "max_tokens of zero"),
        (lambda d: d["params"].update(bogus=True), "unknown field in a nested struct"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_invalid_queued_request_refused(mutate: typing.Callable[[dict[str, typing.Any]], None], why: str) -> None:
    raw = _raw(QREQ)
    mutate(raw)
    with pytest.raises(P.ProtocolError):
        P.decode(_pack(raw))


@pytest.mark.parametrize(
    "bad_q",
    [
        {"ids": [1], "probs": [1.0]},  # lists, not packed bytes
        {"ids": b"", "probs": b""},  # empty
        {"ids": b"\x01\0\0\0" * (P.MAX_Q_ENTRIES + 1), "probs": b"\0\x3c" * (P.MAX_Q_ENTRIES + 1)},  # too many
        {"ids": b"\x01\0\0\0"},  # no probabilities
    ],
)
def test_invalid_sparse_q_refused(bad_q: dict[str, object]) -> None:
    raw = _raw(P.Draft(request_id="r", round=0, token_ids=[1], q=[P.SparseQ(ids=b"\x01\0\0\0", probs=b"\0\x3c")]))
    raw["q"] = [bad_q]
    with pytest.raises(P.ProtocolError):
        P.decode(_pack(raw))


def test_draft_longer_than_the_hard_ceiling_refused() -> None:
    raw = _raw(P.Draft(request_id="r", round=0, token_ids=[1]))
    raw["token_ids"] = [1] * (P.MAX_DRAFT_TOKENS + 1)
    with pytest.raises(P.ProtocolError):
        P.decode(_pack(raw))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"\xa5hello", b"\x81\xa4type", b"\xdd\xff\xff\xff\xff"])
def test_malformed_bytes_refused(data: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(data)


def _decode_or_protocol_error(data: bytes) -> None:
    try:
        msg = P.decode(data)
    except P.ProtocolError:
        return
    assert isinstance(msg, typing.get_args(P.Message))


def test_fuzz_random_bytes() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        _decode_or_protocol_error(rng.randbytes(rng.randrange(0, 64)))


def test_fuzz_mutated_valid_frames() -> None:
    rng = random.Random(4321)
    frames = [P.encode(m) for m in SAMPLES]
    for _ in range(2000):
        data = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            pos = rng.randrange(len(data) + 1)
            if op == 0 and pos < len(data):
                data[pos] = rng.randrange(256)
            elif op == 1:
                data[pos:pos] = rng.randbytes(rng.randint(1, 4))
            else:
                del data[pos : pos + rng.randint(1, 4)]
        _decode_or_protocol_error(bytes(data))


def test_deeply_nested_frame_refused() -> None:
    data = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(P.ProtocolError):
        P.decode(data)


def test_encode_of_a_struct_is_msgpack_map_with_type_tag() -> None:
    raw = _raw(P.Cancel(request_id="r9"))
    assert raw == {"type": "cancel", "request_id": "r9"}
    assert isinstance(msgspec.msgpack.decode(P.encode(P.Cancel(request_id="r9"))), dict)


def test_batch_packs_several_messages_and_unpacks_in_order() -> None:
    verdicts = [P.Verdict(request_id=f"r{i}", round=i, accepted=0, token_ids=[i], finished=False, finish_reason=None,
                          draft_budget=2) for i in range(3)]
    assert P.unpack(P.decode(P.encode_many(verdicts))) == verdicts
    assert P.decode(P.encode_many(verdicts[:1])) == verdicts[0]  # one message travels alone


@pytest.mark.parametrize("items", [[], [P.QueuePull(max_items=1)], [P.Batch(items=[P.Cancel(request_id="r")])]])
def test_batch_refuses_empty_or_unbatchable_items(items: list[typing.Any]) -> None:
    raw = msgpack.packb({"type": "batch", "items": [msgspec.to_builtins(i) for i in items]})
    with pytest.raises(P.ProtocolError):
        P.decode(raw)


def test_an_open_session_cannot_claim_a_negative_wait() -> None:
    raw = _raw(P.OpenSession(request_id="r1", prompt_ids=[5], params=P.SamplingParams(), origin="c", waited_s=1.0))
    raw["waited_s"] = -1.0
    with pytest.raises(P.ProtocolError):
        P.decode(_pack(raw))
