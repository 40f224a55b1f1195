"""The lean forward's matmuls: padded rows, and oneDNN's reordered weights where this machine has them."""

from __future__ import annotations

import pytest
import torch

from shared.runner import matmul as matmul_mod
from shared.runner.matmul import Matmul, matmul, packing_available

CPU = torch.device("cpu")
PACKABLE = [d for d in (torch.float32, torch.bfloat16) if packing_available(CPU, d)]


@pytest.mark.parametrize("rows,multiple,padded", [(1, 4, 4), (4, 4, 4), (5, 4, 8), (9, 8, 16), (3, 1, 3), (2, 0, 2)])
def test_a_plain_matmul_pads_rows_to_the_multiple_and_drops_them(rows: int, multiple: int, padded: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = matmul_mod.F.linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(matmul_mod.F, "linear", spy)
    weight, x = torch.randn(8, 6), torch.randn(rows, 6)
    out = Matmul(weight, None, "plain", multiple=multiple)(x)
    assert seen == [padded] and out.shape == (rows, 8)
    assert torch.allclose(out, x @ weight.T, atol=1e-5)


@pytest.mark.skipif(not PACKABLE, reason="oneDNN cannot reorder weights on this machine")
@pytest.mark.parametrize("dtype", PACKABLE, ids=str)
@pytest.mark.parametrize("rows,multiple", [(1, 0), (1, 2), (5, 2), (7, 4)])
def test_a_packed_matmul_multiplies_by_the_weight_and_its_bias(dtype: torch.dtype, rows: int, multiple: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(rows, 24, generator=gen)  # float32 activations: rounded to the weight's dtype first
    packed = matmul(weight, bias, multiple, kernel="onednn")
    assert packed.kind == "onednn"
    out = packed(x)
    want = torch.nn.functional.linear(x.to(dtype), weight, bias)
    assert out.dtype == dtype and out.shape == (rows, 40)
    assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_gpu_or_unsupported_dtype_is_not_packed() -> None:
    assert not packing_available(torch.device("cuda"), torch.float32)
    assert not packing_available(CPU, torch.float16)
    assert not matmul(torch.randn(4, 4).half()).packed
