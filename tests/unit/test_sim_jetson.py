"""The Jetson-against-H100 projection (bench/sim/jetson_h100.py): its costs reproduce the published
numbers they come from, and a small sweep writes its page with a speed-up per row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.costs import H100Cost, TransformerShape
from bench.sim.jetson_h100 import (
    H100_DECODE_STEP_S,
    H100_PREFILL_S,
    H100_PREFILL_TOKENS,
    JETSON_TOK_S_B1,
    JETSON_TOK_S_B8,
    Point,
    jetson_costs,
    main,
    published_gpu,
    spec_of,
    with_speedups,
)


def test_the_h100_costs_give_back_the_published_decode_step_and_prefill() -> None:
    """Lambda's run: about 7.2 ms a decode step at up to 10 rows, 62 ms for 1,369 prompt tokens."""
    cost = H100Cost(TransformerShape(), published_gpu())
    decode = cost.predict_sums(new=10, total_new=10 * 300, cached=10 * 300)
    prefill = cost.predict_sums(new=H100_PREFILL_TOKENS, total_new=H100_PREFILL_TOKENS * 137,
                                cached=0)
    assert decode == pytest.approx(H100_DECODE_STEP_S, rel=0.05)  # the KV cache's few MB aside
    assert prefill == pytest.approx(H100_PREFILL_S, rel=0.05)
    assert 0.5 < published_gpu().hbm_efficiency < 1 and 0.2 < published_gpu().flops_efficiency < 1


def test_the_jetson_costs_give_back_the_published_rates_at_batch_1_and_8() -> None:
    forward_s, row_s, prefill_s = jetson_costs()
    assert forward_s + row_s == pytest.approx(1 / JETSON_TOK_S_B1)
    assert forward_s + 8 * row_s == pytest.approx(8 / JETSON_TOK_S_B8)
    assert forward_s > 0 and row_s > 0 and prefill_s == pytest.approx(0.2155 / 383)


def test_a_point_is_jetsons_of_one_user_each_for_the_same_simulated_time() -> None:
    spec = spec_of(Point(3, 0.9, 40.0, "fixed k=2"), prompt_len=16, max_tokens=32, duration_s=5.0)
    d = spec.drafters[0]
    assert len(spec.drafters) == 3 and spec.speculative and spec.policies.draft_len == 2
    assert (d.concurrency, d.alpha, d.rtt_s, d.forward_s) == (1, 0.9, pytest.approx(0.04), jetson_costs()[0])
    assert spec.cost.kind == "h100" and spec.duration_s == 5.0 and spec.rounds is None
    base = spec_of(Point(3, 0.9, 40.0, "target-only"), 16, 32, 5.0)
    assert not base.speculative and base.duration_s == spec.duration_s
    assert spec_of(Point(1, 0.9, 0.0, "smartspec"), 16, 32, 5.0).policies.allocation == "smartspec"


def test_each_speedup_is_over_the_target_only_row_of_the_same_fleet() -> None:
    rows = [{"drafters": n, "alpha": a, "rtt_ms": 20.0, "mode": m, "goodput_tok_s": g}
            for n, a, m, g in ((1, 0.9, "target-only", 100.0), (1, 0.9, "fixed k=4", 50.0),
                               (2, 0.9, "target-only", 200.0), (2, 0.9, "fixed k=4", 300.0),
                               (2, 0.5, "fixed k=4", 10.0))]
    assert [r["speedup"] for r in with_speedups(rows)] == [1.0, 0.5, 1.0, 1.5, None]


def test_a_small_sweep_writes_its_page(tmp_path: Path) -> None:
    assert main(["--drafters", "2", "--alphas", "0.9", "--modes", "fixed k=2", "--duration-s", "2",
                 "--seeds", "1", "--max-tokens", "16", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sim-jetson-h100.json").read_text())
    assert [r["mode"] for r in data["rows"]] == ["target-only", "fixed k=2"]  # its baseline added
    assert all(r["goodput_tok_s"] > 0 and r["speedup"] > 0 for r in data["rows"])
    page = (tmp_path / "sim-jetson-h100.md").read_text()
    assert "LambdaLabsML/vllm-benchmark" in page and "TensorRT-Edge-LLM" in page


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["--modes", "fixed k=3"])
    assert usage.value.code == 2 and "unknown mode(s) fixed k=3" in capsys.readouterr().err
