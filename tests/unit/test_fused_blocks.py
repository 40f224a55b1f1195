"""The fused decoder blocks (rowwise.cpp's Layer, shared.runner.lean.fused_reason): each block one C++
call that computes what the torch-op block computes, and is batch-invariant as it stands."""

from __future__ import annotations

import pytest
import torch

from shared.models import ModelLoadError
from shared.runner import ModelRunner, lean, rowwise
from shared.runner.step import Segment
from tests.unit.runner_models import ARCHS, KV_BUDGET, assert_close, full_logits, tiny_model, token_ids

needs_avx2 = pytest.mark.skipif(not {"avx2", "fma"} <= rowwise._cpu_flags(), reason="this CPU lacks AVX2/FMA")
FUSABLE = [a for a in ARCHS if ARCHS[a][2].get("hidden_act", "silu") == "silu"]


def _step(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Three sessions in one step: one prefilled and verifying 4 drafts, one fresh, one decoding."""
    slots = [runner.kv.allocate(len(ids) + 8) for _ in range(3)]
    assert all(s is not None for s in slots)
    a, b, c = slots
    assert a is not None and b is not None and c is not None
    runner.forward([Segment(a, ids[:20], 20), Segment(c, ids[5:25], 20)])
    out = runner.forward([Segment(a, ids[20:25], 0), Segment(b, ids[:9], 0), Segment(c, ids[25:26], 0)])
    for s in slots:
        runner.kv.free(s)
    assert out is not None
    return out


@needs_avx2
@pytest.mark.parametrize("arch", FUSABLE)
def test_a_fused_block_computes_what_the_torch_block_computes(arch: str) -> None:
    loaded = tiny_model(arch)
    fused = ModelRunner(loaded, KV_BUDGET, "lean")
    ops = ModelRunner(loaded, KV_BUDGET, "lean", fuse=False)
    assert fused.fused and fused.describe()["fused_blocks"] is True and not ops.fused
    ids = token_ids(30)
    assert_close(_step(fused, ids), _step(ops, ids), rtol=1e-5)
    assert_close(_step(fused, ids)[:5], full_logits(loaded.model, ids[:25])[20:], rtol=1e-4)


@needs_avx2
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-bias"])
def test_fused_blocks_are_batch_invariant_with_no_padding(arch: str) -> None:
    runner = ModelRunner(tiny_model(arch), KV_BUDGET, "lean", batch_invariant=True)  # checks itself, bitwise
    assert runner.fused and runner.attention_multiple == 0 and runner.row_multiple == 1
    ids = token_ids(30, seed=3)
    wide = _step(runner, ids)
    slot = runner.kv.allocate(40)
    assert slot is not None
    runner.forward([Segment(slot, ids[:20], 20)])
    alone = [runner.forward([Segment(slot, [t], 0)]) for t in ids[20:25]]
    assert torch.equal(torch.cat([r for r in alone if r is not None]), wide[:5])


@needs_avx2
def test_threads_change_no_bit() -> None:
    runner = ModelRunner(tiny_model("llama-mha-hd32"), KV_BUDGET, "lean")
    ids = token_ids(30, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _step(runner, ids)
        torch.set_num_threads(2)
        two = _step(runner, ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


class _OneKeyShort:
    """A fused block that attends over one key fewer than each row sees."""

    def __init__(self, native: object) -> None:
        self.native = native

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor,
                spans: torch.Tensor) -> torch.Tensor:
        short = spans.clone()
        short[:, 3] -= (short[:, 3] > short[:, 1]).long()  # never below the span's own rows
        return self.native.forward(x, cos, sin, kv, rows, short)  # type: ignore[attr-defined, no-any-return]


@needs_avx2
def test_the_self_check_covers_the_fused_blocks() -> None:
    runner = ModelRunner(tiny_model("qwen2"), KV_BUDGET, "lean")
    layer = runner.decoder.layers[1]  # type: ignore[attr-defined]
    layer.native = _OneKeyShort(layer.native)
    with pytest.raises(ModelLoadError, match="the lean runner disagrees with transformers"):
        runner.check_against_reference()


@pytest.mark.parametrize("kernel,dtype,act,reason", [
    ("onednn", torch.float32, "silu", "run on onednn, not the row-wise kernel"),
    ("rowwise", torch.bfloat16, "silu", "weights are torch.bfloat16"),
    ("rowwise", torch.float32, "gelu", "activation is 'gelu', not silu"),
    ("rowwise", torch.float32, "silu", ""),
])
def test_what_runs_fused(kernel: str, dtype: torch.dtype, act: str, reason: str) -> None:
    loaded = tiny_model("llama", hidden_act=act)
    loaded.model.to(dtype)
    got = lean.fused_reason(loaded.model, kernel, dtype)
    assert (reason in got and got) if reason else got == ""


@needs_avx2
def test_a_step_outside_the_arena_is_refused_not_read() -> None:
    runner = ModelRunner(tiny_model("llama"), KV_BUDGET, "lean")
    layer = runner.decoder.layers[0].native  # type: ignore[attr-defined]
    x, cs = torch.randn(1, 64), torch.ones(1, 16)
    kv = torch.zeros(2, 2, 32, 16)
    with pytest.raises(RuntimeError, match="a span outside the step or the arena"):
        layer.forward(x, cs, cs, kv, torch.tensor([0]), torch.tensor([[0, 1, 20, 40]]))
    with pytest.raises(RuntimeError, match="arena row out of range"):
        layer.forward(x, cs, cs, kv, torch.tensor([32]), torch.tensor([[0, 1, 0, 1]]))
    with pytest.raises(RuntimeError, match="wrong shape"):
        layer.forward(torch.randn(1, 63), cs, cs, kv, torch.tensor([0]), torch.tensor([[0, 1, 0, 1]]))


@needs_avx2
def test_bfloat16_weights_run_fused_as_their_float32_widening_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 weights on the row-wise kernel, widened (a CPU without AVX512-BF16): float32 activations
    and sums, so a bfloat16 model's logits are bitwise those of the same weights widened to float32."""
    monkeypatch.setattr(rowwise, "pairs_available", lambda: False)
    half = tiny_model("qwen3")
    half.model.to(torch.bfloat16)
    wide = tiny_model("qwen3")
    wide.model.to(torch.bfloat16).to(torch.float32)
    a = ModelRunner(half, KV_BUDGET, "lean", batch_invariant=True, matmul="rowwise")
    b = ModelRunner(wide, KV_BUDGET, "lean", batch_invariant=True)
    assert a.fused and a.describe()["dtype"] == "bfloat16" and a.describe()["activations"] == "float32"
    ids = token_ids(30, seed=5)
    assert torch.equal(_step(a, ids), _step(b, ids))


@pytest.mark.skipif(not {"avx2", "fma", "avx512_bf16"} <= rowwise._cpu_flags(), reason="this CPU lacks AVX512-BF16")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-bias"])
def test_bfloat16_pairs_run_fused_batch_invariant_and_as_the_torch_block(arch: str) -> None:
    """bfloat16 weights on AVX512-BF16's dot product (the activations rounded to bfloat16 at each
    matmul): each fused block computes what the torch-op block computes on the same kernel, and a
    row's logits are bitwise the same alone or in a wider step."""
    half = tiny_model(arch)
    half.model.to(torch.bfloat16)
    fused = ModelRunner(half, KV_BUDGET, "lean", batch_invariant=True)  # checks itself, bitwise
    ops = ModelRunner(half, KV_BUDGET, "lean", fuse=False)
    assert fused.matmul == "rowwise" and fused.fused and fused.row_multiple == 1 and not ops.fused
    ids = token_ids(30, seed=9)
    wide = _step(fused, ids)
    assert_close(wide, _step(ops, ids), rtol=1e-4)
    slot = fused.kv.allocate(40)
    assert slot is not None
    fused.forward([Segment(slot, ids[:20], 20)])
    alone = [fused.forward([Segment(slot, [t], 0)]) for t in ids[20:25]]
    assert torch.equal(torch.cat([r for r in alone if r is not None]), wide[:5])


@needs_avx2
def test_a_fused_block_never_reads_an_unwritten_arena_row() -> None:
    got = []
    for fill in (0.0, float("nan")):
        runner = ModelRunner(tiny_model("llama"), KV_BUDGET, "lean", batch_invariant=True)
        runner.kv.data.fill_(fill)
        got.append(_step(runner, token_ids(30, seed=6)))
    assert torch.equal(got[0], got[1])
