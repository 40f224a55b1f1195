"""bench.costs' draft-batch timing: every batch drafts all its sessions' tokens, and the line fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.costs import draft_costs, fit_line
from shared.models import load_model


@pytest.mark.parametrize(("xs", "ys", "want"), [
    ([1.0, 2.0, 4.0], [3.0, 5.0, 9.0], (1.0, 2.0)),  # on the line
    ([1.0, 2.0, 3.0], [1.0, 3.0, 2.0], (1.0, 0.5)),  # least squares through the scatter
])
def test_fit_line_gives_intercept_and_slope(xs: list[float], ys: list[float], want: tuple[float, float]) -> None:
    assert fit_line(xs, ys) == pytest.approx(want)


def test_draft_costs_time_each_batch_size_with_every_session_drafting(tiny_models: dict[str, Path]) -> None:
    """Batches of 1, 2 and 8 sessions (the arena holds them all: a session without room would
    draft nothing and the timing would be of a smaller batch, which raises)."""
    out = draft_costs(load_model(tiny_models["draft-L1"]), [1, 2, 8], k=3, prompt_len=8, repeats=2)
    assert list(out["draft_batch_ms"]) == [1, 2, 8] and all(ms > 0 for ms in out["draft_batch_ms"].values())
    per_forward = [ms / 3 for ms in out["draft_batch_ms"].values()]
    assert (out["draft_forward_ms"], out["draft_row_ms"]) == pytest.approx(fit_line([1.0, 2.0, 8.0], per_forward))
    if out["draft_row_ms"] > 0:
        assert out["draft_forward_rows"] == pytest.approx(out["draft_forward_ms"] / out["draft_row_ms"])
