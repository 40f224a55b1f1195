"""The analytic speedup bound of bench single, and the per-token acceptance it starts from."""

from __future__ import annotations

import pytest

from bench.single import per_token_alpha, speedup_bound


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
