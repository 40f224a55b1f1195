"""The analytic speedup bound of bench single, and the per-token acceptance it starts from; the
ceiling bench row-costs puts on speculation from each core's measured row costs."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.edge import Edge
from bench.peers import HF_ASSISTANT
from bench.profile import largest, smallest, weight_bytes
from bench.row_costs import ceiling, tokens_per_round, write
from bench.single import assistant_for, per_token_alpha, speedup_bound


@pytest.mark.parametrize(("alpha", "k"), [(0.0, 4), (0.3, 4), (0.8, 4), (0.95, 6), (0.5, 1)])
def test_per_token_alpha_inverts_the_round_acceptance(alpha: float, k: int) -> None:
    acceptance = sum(alpha**i for i in range(1, k + 1)) / k
    assert per_token_alpha(acceptance, k) == pytest.approx(alpha, abs=1e-6)


@pytest.mark.parametrize(("alpha", "k", "c", "verify", "want"), [
    (0.0, 4, 0.0, 1.0, 1.0),  # nothing accepted, free drafts: one token per target step
    (1.0, 4, 0.0, 1.0, 5.0),  # everything accepted: k + 1 tokens per step
    (0.8, 4, 0.0, 1.0, (1 - 0.8**5) / 0.2),
    (0.8, 4, 0.25, 1.0, (1 - 0.8**5) / 0.2 / 2.0),  # Leviathan et al.: / (k c + 1)
    (0.8, 4, 0.25, 1.6, (1 - 0.8**5) / 0.2 / 2.6),  # a CPU's verification of k + 1 tokens costs more
])
def test_speedup_bound(alpha: float, k: int, c: float, verify: float, want: float) -> None:
    assert speedup_bound(alpha, k, c, verify) == pytest.approx(want)


def test_the_cheapest_draft_counts_a_gguf_copy_by_its_file(tmp_path: Path) -> None:
    q4, q8, hf = tmp_path / "t.Q4_1.gguf", tmp_path / "t.Q8_0.gguf", tmp_path / "draft-small"
    q8.write_bytes(b"x" * 300)
    q4.write_bytes(b"x" * 200)
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"x" * 100)
    assert weight_bytes(q4) == 200 and weight_bytes(hf) == 100
    assert smallest([q8, q4]) == q4 and largest([q4, q8]) == q8 and smallest([q8, q4, hf]) == hf


@pytest.mark.parametrize(("draft", "want"), [(Path("m/t.Q4_1.gguf"), HF_ASSISTANT), (Path("models/draft-large"),
                                                                                  Path("models/draft-large"))])
def test_hf_assisted_generation_takes_the_distilled_draft_for_a_gguf_copy(draft: Path, want: Path) -> None:
    assert assistant_for(draft) == want


@pytest.mark.parametrize(("alpha", "k", "want"), [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.9, 3, 3.439)])
def test_tokens_per_round(alpha: float, k: int, want: float) -> None:
    assert tokens_per_round(alpha, k) == pytest.approx(want)


def step(rows: int) -> float:
    """A verification of 10 ms and 1 ms a row."""
    return 0.010 + 0.001 * rows


@pytest.mark.parametrize(("alpha", "draft_s", "want_k", "want_ratio"), [
    (1.0, 0.0, 8, 11 / (19 / 9)),  # free drafts, all accepted: the longest draft, the verifier the bound
    (1.0, 0.011, 1, 11 / 6),  # a draft step as dear as the target's: one draft, then the edge is the bound
    (0.0, 0.0, 1, 11 / 12),  # nothing accepted: one token a round whatever k, the cheapest round wins
])
def test_the_ceiling_is_the_busier_core_at_the_best_length(alpha: float, draft_s: float, want_k: int,
                                                          want_ratio: float) -> None:
    c = ceiling(1, step, draft_s, alpha, max_k=8)
    assert (c.k, c.ratio) == (want_k, pytest.approx(want_ratio))
    assert c.target_only_ms == pytest.approx(11.0)
    assert c.verifier_alone >= c.ratio  # free drafts never reach less


def test_the_ceiling_counts_a_step_of_many_sessions_per_token() -> None:
    # 4 sessions: target-only 14 ms for 4 tokens; at k = 8, all accepted, 46 ms for 36 tokens
    c = ceiling(4, lambda rows: 0.010 + 0.004 * rows, 0.0, 1.0, max_k=8)
    assert c.target_only_ms == pytest.approx(3.5)
    assert c.verifier_ms == pytest.approx(46 / 36)
    assert c.edge_ms == 0.0


def test_row_costs_writes_the_ceiling_and_the_verification_grid(tmp_path: Path) -> None:
    c = ceiling(1, step, 0.005, 0.98, max_k=2)
    row = {**asdict(c), "draft_step_ms": 5.0, "verify_ms": [11.0, 12.0, 13.0]}
    args = argparse.Namespace(width="Q4_1", context=200, max_k=2)
    write(tmp_path, args, ["--max-k", "2"], Edge("0", "1"), 0.98, [row])
    md = (tmp_path / "row-costs.md").read_text()
    assert "`python -m bench row-costs --max-k 2`" in md and "α = 0.980" in md
    assert f"| 1 | 5.00 | {c.ratio:.2f}x | {c.k} |" in md
    assert "| 1 | 11.0 | 12.0 | 13.0 |" in md
    data = json.loads((tmp_path / "row-costs.json").read_text())
    assert data["meta"]["alpha"] == 0.98 and data["results"][0]["k"] == c.k
