"""The verifier's target under ``--dtype auto`` where bfloat16's matmuls cannot be batch-invariant (a
Xeon VM whose CPU lists AMX, in an image without the compiler for the row-wise kernel, 2026-12-05):
it runs in float32 rather than not at all; a dtype asked for by name is refused as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import services.verifier.main as verifier_main
import shared.runner.runner as runner_module
from services.verifier.config import VerifierConfig
from services.verifier.main import load_runner
from shared.config import from_flags
from shared.runner.runner import NotInvariantError


@pytest.fixture
def bfloat16_not_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 matmuls that give a row different results at every multiple; the tiny target (stored
    in float32, which auto keeps) loaded under auto as a bfloat16 checkpoint is."""
    probe, load = runner_module.probe_row_multiples, verifier_main.load_model

    def no_multiple(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                    kernel: str = "auto") -> dict[tuple[int, int], int]:
        return {s: 0 for s in shapes} if dtype == torch.bfloat16 else probe(shapes, dtype, device, kernel)

    def as_bfloat16(path: str | Path, device: str = "cpu", dtype: str = "auto", max_model_len: int = 0) -> Any:
        return load(path, device, "bfloat16" if dtype == "auto" else dtype, max_model_len)

    monkeypatch.setattr(runner_module, "probe_row_multiples", no_multiple)
    monkeypatch.setattr(verifier_main, "load_model", as_bfloat16)


@pytest.mark.usefixtures("bfloat16_not_invariant")
def test_auto_runs_the_target_in_float32(tiny_models: dict[str, Path]) -> None:
    cfg = from_flags(VerifierConfig, model=str(tiny_models["target"]), kv_cache_gb=0.01)
    loaded, runner = load_runner(cfg)
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert runner.weight_dtype == torch.float32 and runner.batch_invariant and runner.row_multiple > 0


@pytest.mark.usefixtures("bfloat16_not_invariant")
def test_bfloat16_asked_for_by_name_is_refused(tiny_models: dict[str, Path]) -> None:
    cfg = from_flags(VerifierConfig, model=str(tiny_models["target"]), kv_cache_gb=0.01, dtype="bfloat16")
    with pytest.raises(NotInvariantError, match="different results at every batch size probed"):
        load_runner(cfg)
