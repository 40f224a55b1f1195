"""The cost of a target-only forward from the verifier's lines per session count: a pure table."""

from __future__ import annotations

from typing import Any

import pytest

from shared.target_only_cost import forward_seconds


@pytest.mark.parametrize(("table", "sessions", "context", "want"), [
    ([], 1.0, 100.0, None),
    ([(1, 0.03, 0.0)], 4.0, 100.0, 0.03),  # one count known: its cost, whatever the count
    ([(1, 0.03, 0.0), (4, 0.036, 0.0)], 0.5, 0.0, 0.03),  # below the smallest count: no cheaper
    ([(1, 0.03, 0.0), (4, 0.036, 0.0)], 2.0, 0.0, pytest.approx(0.032)),  # between: linear
    ([(1, 0.03, 0.0), (4, 0.036, 0.0)], 7.0, 0.0, pytest.approx(0.042)),  # above: the last slope
    ([(1, 0.03, 0.0), (4, 0.029, 0.0)], 8.0, 0.0, pytest.approx(0.029)),  # a falling slope is not followed
    ([(4, 0.02, 1e-5), (1, 0.01, 1e-5)], 1.0, 200.0, pytest.approx(0.012)),  # the table's order does not matter
])
def test_forward_seconds_interpolates_in_the_session_count(table: list[tuple[int, float, float]], sessions: float,
                                                           context: float, want: Any) -> None:
    assert forward_seconds(table, sessions, context) == want
