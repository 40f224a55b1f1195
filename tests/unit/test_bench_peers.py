"""bench real's peers and its table: each peer's timing of an answer, the peers on the tiny family
(assisted generation and prompt lookup are greedy-exact to the target alone; llama.cpp runs a
GGUF), and each row's ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.fleets import Run
from bench.peers import Answer, hf_peer, llamacpp_peer
from bench.peers import main as peers_main
from bench.plots import throughput_latency
from bench.real import STARSD_SESSIONS, fmt, peer_row, scenarios, tokens_per_forward, with_ratios
from bench.scrape import Snapshot

PROMPTS = [[5, 9, 11, 40, 7], [12, 13, 60, 3, 22, 8]]


@pytest.mark.parametrize(("arrivals", "want"), [
    ([], {"tokens": 0, "ttft_s": 0.0, "tpot_s": 0.0, "latency_s": 0.0}),
    # one token at a time: first at 0.5 s, then 4 more over 2 s
    ([(10.5, 1), (11.0, 1), (11.5, 1), (12.0, 1), (12.5, 1)],
     {"tokens": 5, "ttft_s": 0.5, "tpot_s": 0.5, "latency_s": 2.5}),
    # assisted: 3 tokens at once first, then 6 more in two verifications over 1.5 s
    ([(10.2, 3), (11.0, 4), (11.7, 2)], {"tokens": 9, "ttft_s": 0.2, "tpot_s": 1.5 / 6, "latency_s": 1.7}),
    ([(10.3, 4)], {"tokens": 4, "ttft_s": 0.3, "tpot_s": 0.0, "latency_s": 0.3}),  # all at once: no TPOT
])
def test_an_answer_times_its_first_token_and_the_rest(arrivals: list[tuple[float, int]],
                                                      want: dict[str, float]) -> None:
    got = Answer(10.0, arrivals).outcome()
    assert {k: got[k] for k in want} == pytest.approx(want)


def test_arrive_counts_ids_at_the_time_they_came() -> None:
    answer = Answer(0.0)
    answer.arrive([4, 5])
    answer.arrive([6])
    assert answer.ids == [4, 5, 6] and [n for _, n in answer.arrivals] == [2, 1]
    assert answer.outcome()["tokens"] == 3


@pytest.fixture(scope="module")
def alone(tiny_models: dict[str, Path]) -> dict[str, Any]:
    return hf_peer("hf", str(tiny_models["target"]), "", "float32", PROMPTS, 12)


@pytest.mark.parametrize("peer", ["hf-assisted", "hf-lookup"])
def test_transformers_speculation_answers_as_the_target_alone_in_fewer_forwards(
        peer: str, alone: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    got = hf_peer(peer, str(tiny_models["target"]), str(tiny_models["draft-L1"]), "float32", PROMPTS, 12)
    assert [o["ids"] for o in got["outcomes"]] == [o["ids"] for o in alone["outcomes"]]
    tokens = sum(o["tokens"] for o in got["outcomes"])
    assert alone["forwards"] == tokens and got["forwards"] <= tokens
    assert all(o["ttft_s"] > 0 and o["latency_s"] >= o["ttft_s"] for o in got["outcomes"])


def test_llamacpp_runs_the_targets_gguf_copy_to_the_same_answers(alone: dict[str, Any],
                                                                  tiny_ggufs: dict[str, Path]) -> None:
    got = llamacpp_peer(str(tiny_ggufs["target"]), PROMPTS, 12)
    assert [o["ids"] for o in got["outcomes"]] == [o["ids"] for o in alone["outcomes"]]
    assert got["forwards"] == sum(o["tokens"] for o in got["outcomes"])


def test_the_peer_command_prints_one_json_result(tiny_models: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:1]))
    assert peers_main(["--peer", "hf", "--model", str(tiny_models["target"]), "--prompts", str(prompts),
                       "--dtype", "float32", "--max-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["peer"] == "hf" and len(out["outcomes"]) == 1 and out["outcomes"][0]["tokens"] == 4


def test_a_peer_row_has_a_fleet_rows_shape() -> None:
    result = {"outcomes": [{"tokens": 10, "ttft_s": 0.1, "tpot_s": 0.02, "latency_s": 0.28},
                           {"tokens": 30, "ttft_s": 0.3, "tpot_s": 0.04, "latency_s": 1.46}],
              "wall_s": 2.0, "forwards": 20, "drafted": 40, "accepted": 30}
    row = peer_row("vllm-ngram", result)
    assert row["tokens_per_s"] == 20.0 and row["concurrency"] == 1
    assert row["acceptance"] == 0.75 and row["tokens_per_forward"] == 2.0
    assert row["tpot_ms"]["p50"] == pytest.approx(30.0) and row["ttft_s_p50"] == pytest.approx(0.2)
    assert peer_row("hf", {**result, "drafted": 0})["acceptance"] is None


def test_ratios_are_to_target_only_at_the_same_concurrency_and_to_the_floor_at_one() -> None:
    rows = [{"scenario": "target-only", "concurrency": 1, "tokens_per_s": 25.0},
            {"scenario": "target-only", "concurrency": 4, "tokens_per_s": 80.0},
            {"scenario": "fleet", "concurrency": 1, "tokens_per_s": 50.0},
            {"scenario": "fleet", "concurrency": 4, "tokens_per_s": 60.0},
            {"scenario": "peer", "concurrency": 16, "tokens_per_s": 60.0}]
    out = with_ratios(rows, floor_tok_s=50.0)
    assert [r["vs_target_only"] for r in out] == [1.0, 1.0, 2.0, 0.75, None]
    assert [r["of_floor"] for r in out] == [0.5, None, 1.0, None, None]


@pytest.mark.parametrize(("value", "want"), [(None, "–"), (float("nan"), "–"), (1.234, "1.23x")])
def test_missing_values_show_as_a_dash(value: float | None, want: str) -> None:
    assert fmt(value, ".2f", "x") == want


@pytest.mark.parametrize(("vllm", "samples", "want"), [
    (False, {("specfleet_verifier_steps_total", ()): 40.0,
             ("specfleet_verifier_generated_tokens_total", ()): 100.0}, 2.5),
    (True, {("vllm:iteration_tokens_total_count", (("engine", "0"),)): 50.0,
            ("vllm:generation_tokens_total", (("engine", "0"),)): 100.0}, 2.0),
    (False, {}, None),  # no step counted
])
def test_tokens_per_forward_reads_each_backends_counters(vllm: bool, samples: dict[Any, float],
                                                         want: float | None) -> None:
    run = Run("x", 1, [1.0], [], {"verifier": Snapshot(samples)})
    assert tokens_per_forward(run, vllm) == want


def test_the_throughput_latency_picture_is_drawn(tmp_path: Path) -> None:
    rows = [{"scenario": s, "concurrency": c, "tokens_per_s": r, "tpot_ms": {"p50": t, "p99": t * 1.5}}
            for s, c, r, t in (("target-only", 1, 25.0, 38.0), ("target-only", 4, 80.0, 48.0),
                               ("fleet", 1, 45.0, 21.0), ("peer", 1, 15.0, 65.0))]
    throughput_latency(rows, tmp_path / "p.png", "title")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_starsds_two_fleets_serve_the_same_sessions_with_the_same_draft() -> None:
    """One drafter batching 4 sessions against 4 drafters of one session each: the same Q4_1 copy."""
    table = scenarios(Path("/m/target"))
    shared, apart = table["shared-drafter"], table["drafter-per-session"]
    assert shared.draft == apart.draft == "/m/target.Q4_1.gguf"
    assert (shared.drafters, shared.drafter_flags) == (1, ("--max-sessions", str(STARSD_SESSIONS)))
    assert (apart.drafters, apart.drafter_flags) == (STARSD_SESSIONS, ("--max-sessions", "1"))
    assert table["vllm-fleet"].verifier_flags == ("--backend", "vllm") and not table["default-fleet"].verifier_flags
