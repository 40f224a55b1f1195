"""The 4-bit matmul (``shared/runner/quant4.cpp``) and the GGUF drafts it runs
(``shared.runner.gguf_backend``): its products are the dequantized weight's over the activations
quantized per block, bitwise the same on AVX2 and AVX512-VNNI, whatever the rows and threads; Q4_1
blocks come back exactly from their own dequantized weights; a tiny Q4_1 GGUF drafts on it through the
GGUF proposer as greedy decoding of its own logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.drafter.proposers.base import DraftJob, JobSession
from services.drafter.proposers.gguf import GgufProposer, gguf_draft
from shared.gguf_files import read_gguf
from shared.gguf_write import write_llama_gguf
from shared.models import ModelLoadError
from shared.runner import ModelRunner, Segment, gguf_backend, rowwise
from shared.runner.gguf_backend import exact_matrices, q4_runner, resolve_backend
from shared.runner.runner import greedy_decode
from tests.unit.draft_proposer_support import FULL_GREEDY, PROMPT, gen

pytestmark = pytest.mark.skipif(bool(rowwise.why_unavailable()), reason="the 4-bit kernel cannot run here")


def quantized_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x quantized per block of 32 (as Q8_1) times the dequantized weight, in float64."""
    rows, width = x.shape
    blocks = x.reshape(rows, width // 32, 32)
    scale = blocks.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = (blocks * inv.unsqueeze(-1)).round().clamp(-127, 127)
    xq = (codes * scale.unsqueeze(-1)).reshape(rows, width)
    return xq.double() @ rowwise.q4_dequantized(weight).double().T


@pytest.mark.parametrize(("rows", "width", "out"), [(1, 32, 16), (1, 576, 200), (2, 1536, 100), (3, 64, 40),
                                                   (5, 576, 200), (9, 1536, 17)])
def test_a_product_is_the_dequantized_weights_over_the_quantized_activations(rows: int, width: int, out: int) -> None:
    g = torch.Generator().manual_seed(rows * width)
    weight, x = torch.randn(out, width, generator=g), torch.randn(rows, width, generator=g)
    got = rowwise.linear(x, rowwise.pack_q4(weight), out)
    want = quantized_reference(x, weight)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-5


@pytest.mark.skipif(not rowwise.q4_vnni(), reason="no AVX512-VNNI here to compare AVX2 with")
@pytest.mark.parametrize(("rows", "out"), [(1, 100), (1, 96), (1, 64), (1, 144), (1, 48), (1, 17), (2, 100), (2, 17),
                                           (2, 144), (3, 96), (7, 100)])
def test_avx2_and_avx512_vnni_give_the_same_bits(rows: int, out: int) -> None:
    # 1 row runs four panels at once, from four runs of the panels, and 2 rows two, from two; the
    # remainder's panels one at a time (7, 6, 4, 9, 3 and 2 panels); more rows one panel at a time
    g = torch.Generator().manual_seed(rows * out)
    weight, x = torch.randn(out, 576, generator=g), torch.randn(rows, 576, generator=g)
    packed = rowwise.pack_q4(weight)
    wide = rowwise.linear_q4(x, packed, out, wide=True)
    assert torch.equal(wide, rowwise.linear_q4(x, packed, out, wide=False))
    assert torch.equal(rowwise.linear_q4(x[-1:], packed, out, wide=True), wide[-1:])


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("wide", [False, True])
def test_the_largest_codes_sum_exactly(wide: bool, rows: int) -> None:
    # every weight code 0 or 15 and every activation code +-127: the high nibbles' sums are their largest
    if wide and not rowwise.q4_vnni():
        pytest.skip("no AVX512-VNNI here")
    signs = torch.tensor([1.0, -1.0]).repeat(288)
    weight = torch.stack([signs.roll(i) * 3 for i in range(32)])  # each block's codes 15 or 0 (d = 0.4, m = -3)
    x = torch.stack([signs.abs(), -signs.abs(), signs])[:rows]
    got = rowwise.linear_q4(x, rowwise.pack_q4(weight), 32, wide=wide)
    assert torch.allclose(got.double(), quantized_reference(x, weight), rtol=1e-6, atol=1e-4)


def test_a_row_gets_its_own_result_whatever_the_rows_and_threads() -> None:
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(100, 576, generator=g), torch.randn(7, 576, generator=g)
    packed = rowwise.pack_q4(weight)
    narrow = rowwise.linear_q4(x, packed, 100, wide=False)
    assert torch.equal(rowwise.linear_q4(x[4:5], packed, 100, wide=False), narrow[4:5])
    assert torch.equal(rowwise.linear(x[4:5], packed, 100), rowwise.linear(x, packed, 100)[4:5])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rowwise.linear(x, packed, 100)
        torch.set_num_threads(4)
        assert torch.equal(rowwise.linear(x, packed, 100), one)
    finally:
        torch.set_num_threads(before)


def test_tiny_activations_add_nothing_and_a_nan_shows() -> None:
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    packed = rowwise.pack_q4(weight)
    x = torch.full((3, 64), 1e-37)  # 1 / (max / 127) overflows: the block adds nothing, never a wrong sign
    x[1, 5] = float("nan")
    x[2, :32] = torch.randn(32)
    out = rowwise.linear(x, packed, 16)
    assert torch.equal(out[0], torch.zeros(16))
    assert bool(out[1].isnan().all())
    assert torch.allclose(out[2], quantized_reference(x[2:3].where(x[2:3].abs() > 1e-30, 0.0), weight)[0].float(),
                          atol=1e-4)
    with pytest.raises(RuntimeError, match="linear_q4 wants"):
        rowwise.linear_q4(x, weight, 16, wide=False)


def test_q4_1_blocks_come_back_from_their_own_dequantized_weight() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    once = rowwise.q4_dequantized(weight)
    assert torch.equal(rowwise.q4_dequantized(once), once)
    assert all(torch.equal(a, b) for a, b in zip(rowwise.q4_blocks(once), rowwise.q4_blocks(weight), strict=True))
    with pytest.raises(ValueError, match="multiple of 32"):
        rowwise.pack_q4(torch.randn(4, 40))


@pytest.fixture(scope="module")
def q4_gguf(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tiny_models["target"], tmp_path_factory.mktemp("q4") / "target.Q4_1.gguf", "q4_1")


def test_auto_runs_a_q4_1_file_on_the_kernel_and_keeps_its_blocks(q4_gguf: Path, tiny_ggufs: dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    info = read_gguf(q4_gguf)
    monkeypatch.setattr(gguf_backend, "_llama_gpu", lambda: False)
    assert info.file_type == "Q4_1" and resolve_backend(info, "auto") == "specfleet"
    assert resolve_backend(dataclasses.replace(info, file_type="Q8_0"), "auto") == "specfleet"  # cut to 4 bits
    assert resolve_backend(dataclasses.replace(info, file_type="Q4_0"), "auto") == "llama.cpp"  # cut to Q4_1, it loses
    assert resolve_backend(read_gguf(tiny_ggufs["target"]), "auto") == "llama.cpp"  # a float32 file
    assert resolve_backend(info, "llama.cpp") == "llama.cpp"
    monkeypatch.setattr(gguf_backend, "_llama_gpu", lambda: True)  # llama.cpp built for a GPU drafts there
    assert resolve_backend(info, "auto") == "llama.cpp"
    with pytest.raises(ModelLoadError, match="--gguf-backend must be one of"):
        resolve_backend(info, "onnx")
    runner = q4_runner(info, 1 << 20)
    assert runner.fused and runner.matmul == "q4"
    kept, total = exact_matrices(runner._reference)
    assert kept == total - 1  # every layer's matrix; the head is float32 in this file


def test_auto_falls_back_to_llama_cpp_where_the_kernel_cannot_load_the_file(q4_gguf: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    from shared.runner.llama import LlamaRunner

    def refuse(*_: object, **__: object) -> None:
        raise ModelLoadError("a width that is not a multiple of 32")

    monkeypatch.setattr(gguf_backend, "_llama_gpu", lambda: False)
    monkeypatch.setattr(gguf_backend, "q4_runner", refuse)
    runner = gguf_backend.gguf_runner(read_gguf(q4_gguf), 1 << 20, "auto", threads=1, sequences=2)
    assert isinstance(runner, LlamaRunner)
    runner.close()
    with pytest.raises(ModelLoadError, match="multiple of 32"):
        gguf_backend.gguf_runner(read_gguf(q4_gguf), 1 << 20, "specfleet")


def test_a_q4_gguf_drafts_greedy_decoding_of_its_own_logits(q4_gguf: Path) -> None:
    info = read_gguf(q4_gguf)
    runner = q4_runner(info, 1 << 20)
    proposer = GgufProposer(runner, info)
    assert proposer.backend == "specfleet" and proposer.branches_pay
    assert gguf_draft(info).fingerprint == proposer.info.vocabulary.fingerprint
    proposer.start("a", PROMPT, 64)
    (proposal,) = proposer.propose([DraftJob(JobSession("a", FULL_GREEDY, gen(0)), 6)])
    assert proposal.token_ids == greedy_decode(runner, PROMPT, 6, set())
    assert proposal.q is None and len(proposal.runner_up) == 6


def _prompt_then_decode(runner: ModelRunner, steps: int = 4) -> torch.Tensor:
    """The prompt's logits, then ``steps`` one-token steps' (each over the cached keys and values)."""
    slot = runner.kv.allocate(len(PROMPT) + steps)
    assert slot is not None
    rows = [runner.forward([Segment(slot, PROMPT, 0)])]
    for t in range(steps):
        rows.append(runner.forward([Segment(slot, [PROMPT[t]], 0)]))
    runner.kv.free(slot)
    return torch.cat([r for r in rows if r is not None])


def test_fused_blocks_over_4_bits_match_the_torch_ops(q4_gguf: Path) -> None:
    draft = q4_runner(read_gguf(q4_gguf), 1 << 20)
    loaded = dataclasses.replace(gguf_draft(read_gguf(q4_gguf)), model=draft._reference)
    fused = ModelRunner(loaded, 1 << 20, kind="lean", matmul="q4")  # a float32 cache, as the ops keep
    ops = ModelRunner(loaded, 1 << 20, kind="lean", matmul="q4", fuse=False)
    assert fused.fused and not ops.fused and fused.kv.data.dtype == ops.kv.data.dtype == torch.float32
    assert torch.allclose(_prompt_then_decode(fused), _prompt_then_decode(ops), atol=1e-4, rtol=1e-4)


def test_the_4_bit_draft_keeps_its_cache_in_float16(q4_gguf: Path) -> None:
    draft = q4_runner(read_gguf(q4_gguf), 1 << 20)
    loaded = dataclasses.replace(gguf_draft(read_gguf(q4_gguf)), model=draft._reference)
    full = ModelRunner(loaded, 1 << 20, kind="lean", matmul="q4")
    assert draft.kv.data.dtype == torch.float16 and draft.describe()["kv_cache"] == "float16"
    assert draft.kv.tokens == 2 * full.kv.tokens  # the same bytes hold twice the tokens
    half, single = _prompt_then_decode(draft), _prompt_then_decode(full)
    assert not torch.equal(half, single)  # the keys and values really were rounded
    assert float((half - single).abs().max()) <= 3e-2 * float(single.abs().max())  # 0.011 seen


@pytest.mark.parametrize("name,want", [("float16", torch.float16), ("float32", torch.float32), ("bfloat16", None),
                                       ("", None)])
def test_the_kv_cache_flag_names_its_dtype_or_lists_the_choices(name: str, want: torch.dtype | None) -> None:
    if want is not None:
        assert gguf_backend.kv_cache_dtype(name) == want
        return
    with pytest.raises(ModelLoadError, match="--gguf-kv-cache must be one of float16, float32"):
        gguf_backend.kv_cache_dtype(name)
