"""The dashboard's arithmetic: rates from two verifier readings, the speedup estimate, percentiles,
the verifier's HTTP address and the dashboard's Basic login. Pure and table-driven."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from services.coordinator.fleet import VerifierReadings, _drafter_rows, _rates, http_url, target_only_speedup
from services.coordinator.metrics import RecentSamples
from services.coordinator.state import _basic_password

#: a verifier's target-only forwards: 1 session 17 ms, 4 sessions 23 ms, plus 10 µs a cached row
COST = [(1, 0.017, 1e-5), (4, 0.023, 1e-5)]


def reading(t: float, instance: str = "a", drafters: list[dict[str, Any]] | None = None,
            per_token: float = 0.0, cost: list[tuple[int, float, float]] | None = None,
            between: list[float] | None = None, **totals: float) -> dict[str, Any]:
    base = {"steps": 0.0, "decode_segments": 0.0, "decode_tokens": 0.0, "decode_cached": 0.0, "step_seconds": 0.0,
            "generated": 0.0, "drafted": 0.0, "accepted": 0.0}
    return {"time": t, "instance": instance, "totals": {**base, **totals}, "drafters": drafters or [],
            "estimator": {"sum_new": per_token}, "target_only": cost, "between_forwards": between}


def drafter(node: str, drafted: float, accepted: float, since: float = 0.0, alpha: float | None = None,
            rtt_s: float | None = None) -> dict[str, Any]:
    return {"node": node, "model": "m", "sessions": 1, "alpha": alpha, "budget": 4.0, "trusted": True,
            "connected_since": since, "rtt_s": rtt_s, "drafted_tokens": drafted, "accepted_tokens": accepted}


RATES = [
    # (id, now, then, expected subset)
    ("no-earlier-reading", reading(10, generated=50), None, {}),
    ("clock-did-not-move", reading(10, generated=50), reading(10), {}),
    ("target-only-torch", reading(12, steps=100, decode_segments=100, decode_tokens=100, step_seconds=2.0,
                                  generated=100, per_token=1e-3), reading(10),
     {"tokens_s": 50.0, "tokens_per_forward": 1.0, "batch_sessions": 1.0, "step_ms": 20.0}),
    # with the verifier's target-only cost and its sessions' cached rows: the mean context rides along
    ("priced-torch", reading(11, steps=10, decode_segments=10, decode_tokens=50, decode_cached=1280,
                             step_seconds=0.2, generated=30, cost=COST), reading(10),
     {"tokens_s": 30.0, "tokens_per_forward": 3.0, "step_ms": 20.0, "context": 128.0, "target_only": COST}),
    ("priced-with-its-gaps", reading(11, steps=10, decode_segments=10, decode_cached=1280, step_seconds=0.2,
                                     generated=30, cost=COST, between=[0.001, 0.0005]), reading(10),
     {"context": 128.0, "between_forwards": [0.001, 0.0005]}),
    ("vllm-no-step-times", reading(11, steps=0, decode_segments=10, generated=25, cost=COST), reading(10),
     {"tokens_per_forward": 2.5}),
]


@pytest.mark.parametrize(("now", "then", "expected"), [r[1:] for r in RATES], ids=[r[0] for r in RATES])
def test_rates(now: dict[str, Any], then: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    got = _rates(now, then)
    if not expected:
        assert got == {}
    for key, value in expected.items():
        assert got[key] == value, key


SPEEDUPS = [
    # (id, rates over the window, requests in flight, expected)
    # T0(1) at 100 cached rows: 17 + 1 = 18 ms
    # target-only, forwards back to back: one token an 18 ms -> 1
    ("target-only", {"tokens_s": 1 / 0.018, "target_only": COST, "context": 100.0}, 1.0, pytest.approx(1.0)),
    # 100 tokens/s served where target-only serves one per 18 ms: 1.8 (drafting time counts: only
    # the tokens served enter)
    ("speculating", {"tokens_s": 100.0, "target_only": COST, "context": 100.0}, 1.0, pytest.approx(1.8)),
    # 4 requests in flight: T0(4) = 23 + 1 = 24 ms for 4 tokens; 200 tokens/s served
    ("four-in-flight", {"tokens_s": 200.0, "target_only": COST, "context": 100.0}, 4.0,
     pytest.approx(200 * 0.024 / 4)),
    # fewer than one in flight on average (the window's tail): priced as one
    ("tail-of-a-run", {"tokens_s": 1 / 0.018, "target_only": COST, "context": 100.0}, 0.4, pytest.approx(1.0)),
    # the verifier's busy time between forwards, 1 ms + 0.5 ms a session, is target-only's too:
    # one token a 18 + 1.5 ms served back to back reads 1; 4 sessions at 24 + 3 ms
    ("between-forwards", {"tokens_s": 1 / 0.0195, "target_only": COST, "context": 100.0,
                          "between_forwards": [0.001, 0.0005]}, 1.0, pytest.approx(1.0)),
    ("between-forwards-four", {"tokens_s": 200.0, "target_only": COST, "context": 100.0,
                               "between_forwards": [0.001, 0.0005]}, 4.0, pytest.approx(200 * 0.027 / 4)),
    ("vllm-tau", {"tokens_s": 60.0, "tokens_per_forward": 2.5}, 1.0, 2.5),
]


@pytest.mark.parametrize(("rates", "in_flight", "expected"), [r[1:] for r in SPEEDUPS], ids=[r[0] for r in SPEEDUPS])
def test_target_only_speedup(rates: dict[str, Any], in_flight: float, expected: Any) -> None:
    assert target_only_speedup(rates, in_flight) == expected


def test_drafter_rows_over_the_window() -> None:
    then = reading(10, drafters=[drafter("a", 100, 50)])
    now = reading(12, drafters=[drafter("a", 140, 80, rtt_s=0.012), drafter("b", 20, 5, since=11.0),
                                drafter("c", 9, 9, since=5.0, alpha=0.7)])
    rows = {r["node"]: r for r in _drafter_rows("ws://v", now, then)}
    assert rows["a"]["drafted_tokens_s"] == 20.0 and rows["a"]["acceptance"] == 0.75
    assert rows["a"]["rtt_ms"] == pytest.approx(12.0)
    assert rows["b"]["drafted_tokens_s"] == 10.0 and rows["b"]["acceptance"] == 0.25  # connected in the window
    assert rows["c"]["drafted_tokens_s"] == 0.0 and rows["c"]["acceptance"] == 0.7  # unseen before: α̂ alone
    assert rows["c"]["rtt_ms"] is None


def test_readings_base_skips_another_instance() -> None:
    v = VerifierReadings("ws://v")
    assert v.latest is None and v.base() is None
    for t, instance in ((1, "old"), (2, "new"), (3, "new")):
        v.readings.append(reading(t, instance))
    v.error = ""
    assert v.base() is not None and v.base()["time"] == 2  # type: ignore[index]
    v.error = "cannot read"
    assert v.latest is None


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 0.5, None),
    ([5.0], 0.99, 5.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
    ([float(i) for i in range(1, 101)], 0.99, 99.0),
    ([float(i) for i in range(1, 101)], 0.5, 50.0),
    ([3.0, 1.0, 2.0], 1.0, 3.0),
])
def test_recent_percentiles(values: list[float], q: float, expected: float | None) -> None:
    recent = RecentSamples(window_s=60)
    for v in values:
        recent.add(v, now=100.0)
    assert recent.percentile(q, now=100.0) == expected


def test_recent_samples_forget_old_values() -> None:
    recent = RecentSamples(window_s=60)
    recent.add(9.0, now=0.0)
    recent.add(1.0, now=50.0)
    assert recent.percentile(0.99, now=55.0) == 9.0
    assert recent.percentile(0.99, now=70.0) == 1.0
    assert recent.percentile(0.5, now=200.0) is None


@pytest.mark.parametrize(("url", "expected"), [
    ("ws://127.0.0.1:8100/v1/frontend", "http://127.0.0.1:8100/fleet"),
    ("wss://verifier.example:443/v1/frontend", "https://verifier.example:443/fleet"),
    ("ws://[::1]:8100", "http://[::1]:8100/fleet"),
])
def test_http_url(url: str, expected: str) -> None:
    assert http_url(url, "/fleet") == expected


@pytest.mark.parametrize(("header", "password"), [
    (base64.b64encode(b"ops:sekret").decode(), "sekret"),
    (base64.b64encode(b":sekret:with:colons").decode(), "sekret:with:colons"),
    (base64.b64encode(b"no-colon").decode(), ""),
    ("%%%not-base64", ""),
    (base64.b64encode(b"\xff\xfe:x").decode(), ""),
])
def test_basic_password(header: str, password: str) -> None:
    assert _basic_password(header) == password


@pytest.mark.parametrize(("mode", "expected"), [("target-only", None), ("oracle α=1.0", 1.0),
                                                ("oracle α=0.6", pytest.approx(0.3264)),
                                                ("oracle α=0.8", pytest.approx(0.5904))])
def test_the_oracles_expected_acceptance(mode: str, expected: float | None) -> None:
    from bench.gpu_check import expected_acceptance

    assert expected_acceptance(mode) == expected
