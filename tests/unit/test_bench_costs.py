"""bench.costs' draft-batch timing (every batch drafts all its sessions' tokens, and the line fit),
and the floor beside the runner's matmuls alone."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.costs import _draft_and_commit, draft_costs, fit_line, main
from shared.models import load_model
from shared.runner import ModelRunner
from shared.runner.lean import LeanDecoder


@pytest.mark.parametrize(("xs", "ys", "want"), [
    ([1.0, 2.0, 4.0], [3.0, 5.0, 9.0], (1.0, 2.0)),  # on the line
    ([1.0, 2.0, 3.0], [1.0, 3.0, 2.0], (1.0, 0.5)),  # least squares through the scatter
])
def test_fit_line_gives_intercept_and_slope(xs: list[float], ys: list[float], want: tuple[float, float]) -> None:
    assert fit_line(xs, ys) == pytest.approx(want)


def test_draft_costs_time_each_batch_size_with_every_session_drafting(tiny_models: dict[str, Path]) -> None:
    """Batches of 1, 2 and 8 sessions drafting 3 tokens each: each batch is checked to have drafted
    all of them (a session the arena had no room for would draft nothing, and raise)."""
    out = draft_costs(load_model(tiny_models["draft-L1"]), [1, 2, 8], k=3, prompt_len=8, repeats=2)
    assert list(out["draft_batch_ms"]) == [1, 2, 8] and all(ms > 0 for ms in out["draft_batch_ms"].values())


def test_draft_costs_fit_the_time_per_forward_against_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of k = 2 forwards taking 4, 6 and 10 ms at 1, 2 and 4 rows: 1 ms fixed + 1 ms per row
    per forward, a fixed cost worth 1 row."""
    monkeypatch.setattr("bench.costs.draft_batch_ms", lambda *a: {1: 4.0, 2: 6.0, 4: 10.0})
    out = draft_costs(None, [1, 2, 4], k=2, prompt_len=8, repeats=1)
    assert (out["draft_forward_ms"], out["draft_row_ms"], out["draft_forward_rows"]) == pytest.approx((1.0, 1.0, 1.0))


class ShortProposer:
    """Drafts one token fewer than asked for its first session; records the commits, each taking
    ``commit_s``."""

    def __init__(self, commit_s: float = 0.0) -> None:
        self.commits: list[tuple[str, list[int], int]] = []
        self.commit_s = commit_s

    def propose(self, jobs: list[Any]) -> list[SimpleNamespace]:
        return [SimpleNamespace(token_ids=[7] * (job.k - (i == 0))) for i, job in enumerate(jobs)]

    def commit(self, session_id: str, tokens: list[int], accepted: int) -> None:
        time.sleep(self.commit_s)
        self.commits.append((session_id, tokens, accepted))


def test_a_batch_that_drafted_fewer_tokens_than_asked_raises() -> None:
    jobs = [SimpleNamespace(session_id=f"s{i}", k=3) for i in range(2)]
    with pytest.raises(RuntimeError, match="fewer than 6 tokens"):
        _draft_and_commit(ShortProposer(), jobs, 6)
    proposer = ShortProposer(commit_s=0.05)
    assert _draft_and_commit(proposer, jobs, 5) < 0.05  # the drafter commits apart from its batches: untimed
    assert proposer.commits == [("s0", [7, 7, 5], 2), ("s1", [7, 7, 5], 2)]


def test_the_matmuls_alone_are_every_weight_matrix_once_in_forward_order(tiny_models: dict[str, Path]) -> None:
    """What ``--floor`` times beside the floor: each layer's four products, then the head; together
    every byte the floor counts but the norms' weights."""
    loaded = load_model(tiny_models["target"])
    decoder = ModelRunner(loaded, 1 << 20, "lean").decoder
    assert isinstance(decoder, LeanDecoder)
    mms = decoder.matmuls()
    layers = loaded.model.config.num_hidden_layers
    assert len(mms) == 4 * layers + 1 and mms[:4] == [decoder.layers[0].qkv, decoder.layers[0].o,
                                                       decoder.layers[0].gate_up, decoder.layers[0].down]
    assert mms[-1] is decoder.lm_head
    norms = sum(p.numel() * p.element_size() for n, p in loaded.model.named_parameters() if "norm" in n)
    matrices = sum(m.source.numel() * m.source.element_size() for m in mms)
    params = {p.data_ptr(): p for p in loaded.model.parameters()}
    embed = loaded.model.get_input_embeddings().weight
    if embed.data_ptr() != loaded.model.get_output_embeddings().weight.data_ptr():
        params.pop(embed.data_ptr())  # as the floor counts: an untied table is read a row a step
    assert matrices + norms == sum(p.numel() * p.element_size() for p in params.values())


def test_floor_reports_the_matmuls_alone(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_models["target"]), "--floor", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["floor"]["floor_tok_s"] > 0 and out["matmuls_tok_s"] > 0


def test_bench_decode_shows_the_row_wise_kernel_beside_onednn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import decode

    monkeypatch.setattr(decode, "OUT", tmp_path)
    monkeypatch.setattr(decode, "machine_stem", lambda stem: stem)
    floor = {"weight_bytes": 538e6, "dtype": "float32", "gemv_gb_s": 16.0, "gemv": "specfleet row-wise"}
    text = decode.write({"floor": floor, "floor_tok_s": 30.0, "floor_tok_s_again": 29.0, "when": "now",
                         "command": "python -m bench decode", "cpu": "avx2", "cpus": "0", "dtype": "float32",
                         "activations": "float32", "tokens": 128, "matmul": "rowwise", "matmuls_tok_s": 24.0,
                         "runner_invariant_tok_s": 15.0, "runner_plain_tok_s": 15.3, "transformers_tok_s": 9.0,
                         "matmuls_onednn_tok_s": 12.0, "runner_invariant_onednn_tok_s": 10.0,
                         "fused_blocks": True, "runner_invariant_unfused_tok_s": 11.0})
    assert ("| specfleet runner, batch-invariant (as served; rowwise matmuls; each block one C++ call) | 15.0 | 0.50 |"
            in text)
    assert "| specfleet runner, batch-invariant, each block as torch ops (the same matmuls) | 11.0 | 0.37 |" in text
    assert "| specfleet runner's matmuls alone, oneDNN's kernel | 12.0 | 0.40 |" in text
    assert "oneDNN's matmuls (`--matmul onednn`) | 10.0 | 0.33 |" in text
    assert (tmp_path / "decode.json").exists()


def test_bench_decode_reports_a_kernel_the_runner_refused_and_no_other_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import decode

    why = ("this machine's torch.bfloat16 matmuls give a row different results at every batch size probed, so "
           "speculation could change the text")
    failed = f"bench.costs failed (1):\nTraceback ...\nshared.runner.runner.NotInvariantError: {why}\n"
    assert decode.refusal(failed) == why
    assert decode.refusal("bench.costs failed (1):\nTraceback ...\nMemoryError: out of memory\n") == ""

    monkeypatch.setattr(decode, "OUT", tmp_path)
    monkeypatch.setattr(decode, "machine_stem", lambda stem: stem)
    floor = {"weight_bytes": 269e6, "dtype": "bfloat16", "gemv_gb_s": 25.0, "gemv": "specfleet row-wise"}
    text = decode.write({"floor": floor, "floor_tok_s": 90.0, "floor_tok_s_again": 91.0, "when": "now",
                         "command": "python -m bench decode", "cpu": "avx512_bf16", "cpus": "0",
                         "dtype": "bfloat16", "activations": "float32", "tokens": 128, "matmul": "rowwise",
                         "runner_invariant_tok_s": 50.0, "runner_plain_tok_s": 51.0, "transformers_tok_s": 20.0,
                         "refused_onednn": why})
    refused = f"`--matmul onednn` was not measured: the runner refused to serve batch-invariant on it here ({why})."
    assert refused in text
    assert "oneDNN's matmuls" not in text


@pytest.mark.parametrize("last_line, refused", [
    ("shared.runner.runner.NotInvariantError: rows differ at every batch size probed", True),
    ("MemoryError: out of memory", False),
])
def test_bench_decode_measures_the_rest_only_past_a_refusal(monkeypatch: pytest.MonkeyPatch, last_line: str,
                                                            refused: bool) -> None:
    from bench import decode

    floor = {"floor_tok_s": 50.0}
    served = {"floor": floor, "dtype": "bfloat16", "activations": "float32", "matmul": "rowwise", "matmuls_tok_s": 45.0,
              "runner_decode_tok_s": 40.0, "hf_decode_tok_s": 15.0, "kernels": ["rowwise", "onednn"]}

    def child(module: str, cpus: str, args: list[str]) -> dict[str, Any]:
        if "onednn" in args:
            raise RuntimeError(f"bench.costs failed (1):\nTraceback ...\n{last_line}\n")
        return served

    monkeypatch.setattr(decode, "run_pinned", child)
    if not refused:
        with pytest.raises(RuntimeError, match="MemoryError"):
            decode.measure(Path("m"), "auto", 8, "0", vllm=False)
        return
    out = decode.measure(Path("m"), "auto", 8, "0", vllm=False)
    assert out["refused_onednn"] == "rows differ at every batch size probed"
    assert out["runner_invariant_tok_s"] == 40.0 and "runner_invariant_onednn_tok_s" not in out
