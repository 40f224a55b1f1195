"""specfleet's row-wise float32 kernel (shared.runner.rowwise): right, and batch-invariant by construction."""

from __future__ import annotations

import pytest
import torch

from shared.runner import rowwise
from shared.runner.invariant import probe_row_multiples
from shared.runner.matmul import matmul, resolve_kernel

CPU = torch.device("cpu")
needs_avx2 = pytest.mark.skipif(not {"avx2", "fma"} <= rowwise._cpu_flags(), reason="this CPU lacks AVX2/FMA")


@needs_avx2
@pytest.mark.parametrize("out,inp", [(1, 1), (7, 5), (16, 8), (17, 9), (32, 64), (33, 576), (100, 1536)])
def test_it_multiplies_like_float64_and_each_row_alone_is_bitwise_the_same(out: int, inp: int) -> None:
    gen = torch.Generator().manual_seed(out * 1000 + inp)
    weight, x = torch.randn(out, inp, generator=gen), torch.randn(11, inp, generator=gen)
    packed = rowwise.pack(weight)
    full = rowwise.linear(x, packed, out)
    want = x.double() @ weight.double().T
    assert full.shape == (11, out)
    assert torch.allclose(full.double(), want, rtol=1e-5, atol=1e-4 * inp**0.5)
    for rows in range(1, 12):  # any step: the tile a row lands in (3, 2 or 1 rows) does not matter
        assert torch.equal(rowwise.linear(x[:rows], packed, out), full[:rows])
    assert all(torch.equal(rowwise.linear(x[i : i + 1], packed, out), full[i : i + 1]) for i in range(11))


@needs_avx2
def test_threads_and_strided_activations_change_no_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(200, 96, generator=gen), torch.randn(9, 192, generator=gen)[:, ::2]
    packed = rowwise.pack(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rowwise.linear(x, packed, 200)
        torch.set_num_threads(2)
        two = rowwise.linear(x, packed, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, rowwise.linear(x.contiguous(), packed, 200))


@needs_avx2
def test_zero_rows_and_bad_inputs() -> None:
    packed = rowwise.pack(torch.randn(20, 8))
    assert rowwise.linear(torch.empty(0, 8), packed, 20).shape == (0, 20)
    with pytest.raises(RuntimeError, match="activations' width"):
        rowwise.linear(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="float32"):
        rowwise.linear(torch.randn(2, 8).bfloat16(), packed, 20)


@needs_avx2
def test_auto_picks_it_for_float32_and_the_matmul_adds_the_bias_without_padding() -> None:
    assert resolve_kernel("auto", CPU, torch.float32) == "rowwise"
    weight, bias, x = torch.randn(40, 24), torch.randn(40), torch.randn(5, 24)
    m = matmul(weight, bias, multiple=4)
    assert m.kind == "rowwise" and m.packed
    assert torch.allclose(m(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5)
    assert torch.equal(m(x[2:3]), m(x)[2:3])


@needs_avx2
def test_the_start_up_probe_finds_it_needs_no_padding() -> None:
    assert probe_row_multiples([(64, 48), (48, 130)], torch.float32, CPU, "rowwise") == {(64, 48): 1, (48, 130): 1}


def test_a_kernel_that_cannot_run_is_refused_by_name_and_skipped_by_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="must be one of"):
        resolve_kernel("fast", CPU, torch.float32)
    with pytest.raises(ValueError, match=r"bfloat16 weights on a CPU, not torch\.float16"):
        resolve_kernel("rowwise", CPU, torch.float16)
    assert resolve_kernel("auto", CPU, torch.float16) != "rowwise"
    monkeypatch.setattr(rowwise, "_cpu_flags", lambda: {"sse2"})
    monkeypatch.setattr(rowwise, "_told", [])
    rowwise.why_unavailable.cache_clear()
    try:
        assert rowwise.why_unavailable() == "this CPU lacks avx2, f16c, fma"
        with pytest.raises(ValueError, match="lacks avx2, f16c, fma; use --matmul auto"):
            resolve_kernel("rowwise", CPU, torch.float32)
        assert resolve_kernel("auto", CPU, torch.float32) in ("onednn", "plain")
    finally:
        rowwise.why_unavailable.cache_clear()


@needs_avx2
@pytest.mark.parametrize("out,inp", [(7, 5), (33, 576), (100, 1536)])
def test_bfloat16_weights_are_widened_exactly_and_summed_in_float32(out: int, inp: int) -> None:
    gen = torch.Generator().manual_seed(out + inp)
    weight, x = torch.randn(out, inp, generator=gen).bfloat16(), torch.randn(7, inp, generator=gen)
    packed = rowwise.pack(weight, pairs=False)
    assert packed.dtype == torch.bfloat16 and not rowwise.is_pairs(packed)
    got = rowwise.linear(x, packed, out)
    assert got.dtype == torch.float32  # the activations are never rounded to bfloat16
    assert torch.equal(got, rowwise.linear(x, rowwise.pack(weight.float()), out))  # the very float32 chain
    assert all(torch.equal(rowwise.linear(x[i : i + 1], packed, out), got[i : i + 1]) for i in range(7))


@needs_avx2
@pytest.mark.parametrize("native,pairs,want", [(False, False, "rowwise"), (True, False, "onednn"),
                                               (True, True, "rowwise"), (False, True, "rowwise")])
def test_auto_picks_it_for_bfloat16_unless_only_onednn_runs_it_natively(
        monkeypatch: pytest.MonkeyPatch, native: bool, pairs: bool, want: str) -> None:
    from shared.runner import matmul as mm

    with monkeypatch.context() as patch:
        patch.setattr(mm, "packing_available", lambda device, dtype: native)
        patch.setattr(rowwise, "pairs_available", lambda: pairs)
        assert resolve_kernel("auto", CPU, torch.bfloat16) == want
        assert resolve_kernel("auto", CPU, torch.float32) == "rowwise"
        assert resolve_kernel("rowwise", CPU, torch.bfloat16) == "rowwise"  # asked for by name
    m = matmul(torch.randn(20, 8).bfloat16(), torch.randn(20).bfloat16(), kernel="rowwise")
    assert m(torch.randn(3, 8)).dtype == torch.float32 and m(torch.randn(3, 8).bfloat16()).dtype == torch.bfloat16


@needs_avx2
def test_auto_takes_the_pairs_on_a_cpu_that_lists_amx_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Xeon VM that lists AMX (2026-12-05): oneDNN's bfloat16 matmuls were invariant at no row multiple
    on the real model, so ``auto`` keeps the pairs there (it kept oneDNN on AMX until then)."""
    from shared.runner import matmul as mm

    monkeypatch.setattr(mm, "packing_available", lambda device, dtype: True)
    monkeypatch.setattr(rowwise, "pairs_available", lambda: True)
    amx = frozenset({"avx2", "fma", "avx512_bf16", "amx_bf16", "amx_tile"})
    monkeypatch.setattr(rowwise, "_cpu_flags", lambda: amx)
    assert resolve_kernel("auto", CPU, torch.bfloat16) == "rowwise"


needs_bf16_pairs = pytest.mark.skipif(not ({"avx2", "fma", "avx512_bf16"} <= rowwise._cpu_flags()),
                                      reason="this CPU lacks AVX512-BF16 (the bfloat16 pairs)")


@needs_bf16_pairs
@pytest.mark.parametrize("out,inp", [(1, 2), (7, 6), (16, 8), (17, 10), (33, 576), (100, 1536), (70, 64)])
def test_bfloat16_pairs_multiply_rounded_activations_and_each_row_alone_is_bitwise_the_same(out: int,
                                                                                             inp: int) -> None:
    gen = torch.Generator().manual_seed(out * 7 + inp)
    weight, x = torch.randn(out, inp, generator=gen).bfloat16(), torch.randn(11, inp, generator=gen)
    packed = rowwise.pack(weight)  # the default on this CPU
    assert rowwise.pairs_available() and rowwise.is_pairs(packed) and packed.shape[1] == inp // 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = rowwise.linear(x, packed, out)
        torch.set_num_threads(4)
        assert torch.equal(rowwise.linear(x, packed, out), full)
    finally:
        torch.set_num_threads(threads)
    want = x.bfloat16().double() @ weight.double().T  # the activations rounded as oneDNN's bfloat16 rounds them
    assert full.dtype == torch.float32
    assert torch.allclose(full.double(), want, rtol=1e-5, atol=1e-5 * inp**0.5)
    for rows in range(1, 12):  # any step: the tile a row lands in (4, 3, 2 or 1 rows) does not matter
        assert torch.equal(rowwise.linear(x[:rows], packed, out), full[:rows])
    assert all(torch.equal(rowwise.linear(x[i : i + 1], packed, out), full[i : i + 1]) for i in range(11))


needs_amx = pytest.mark.skipif(not ({"avx2", "fma", "avx512_bf16", "amx_bf16"} <= rowwise._cpu_flags()),
                               reason="this CPU lacks AMX-BF16")


def _kernels() -> list[bool]:
    """The pairs' kernels this CPU runs: the dot product's chains, and AMX where it runs."""
    return [False, True] if rowwise.amx_available() else [False]


@needs_bf16_pairs
@pytest.mark.parametrize("out,inp", [(5, 32), (16, 64), (70, 96), (100, 576), (49, 1536)])
def test_each_pairs_kernel_is_bitwise_the_same_for_a_row_in_any_step(out: int, inp: int) -> None:
    """Both of the pairs' kernels, over 40 rows (AMX's blocks of 16: whole, and one of 8 rows) and
    outputs that end mid-panel: a row's result alone, in any step and on any threads is the same."""
    gen = torch.Generator().manual_seed(out * 11 + inp)
    weight, x = torch.randn(out, inp, generator=gen).bfloat16(), torch.randn(40, inp, generator=gen)
    packed = rowwise.pack(weight)
    want = x.bfloat16().double() @ weight.double().T
    threads = torch.get_num_threads()
    for amx in _kernels():
        try:
            torch.set_num_threads(1)
            full = rowwise.linear_pairs(x, packed, out, amx)
            torch.set_num_threads(3)
            assert torch.equal(rowwise.linear_pairs(x, packed, out, amx), full)
        finally:
            torch.set_num_threads(threads)
        assert torch.allclose(full.double(), want, rtol=1e-5, atol=1e-5 * inp**0.5), amx
        for rows in (1, 2, 9, 15, 16, 17, 31, 33, 40):
            assert torch.equal(rowwise.linear_pairs(x[:rows], packed, out, amx), full[:rows]), (amx, rows)
        assert all(torch.equal(rowwise.linear_pairs(x[i : i + 1], packed, out, amx), full[i : i + 1])
                   for i in range(0, 40, 3))


@needs_amx
def test_amx_multiplies_every_pairs_weight_whose_width_fills_its_tiles() -> None:
    """Where AMX runs, it is the one kernel for a weight 32k inputs wide at every row count; a weight of
    another even width keeps the chains at every row count (so its rows stay invariant too)."""
    assert rowwise.amx_available()
    gen = torch.Generator().manual_seed(3)
    for inp, amx in ((64, True), (576, True), (48, False), (10, False)):
        packed = rowwise.pack(torch.randn(30, inp, generator=gen).bfloat16())
        x = torch.randn(9, inp, generator=gen)
        for rows in (1, 9):
            assert torch.equal(rowwise.linear(x[:rows], packed, 30), rowwise.linear_pairs(x[:rows], packed, 30, amx))
    packed = rowwise.pack(torch.randn(30, 48).bfloat16())
    with pytest.raises(RuntimeError, match="amx: where it runs"):
        rowwise.linear_pairs(torch.randn(2, 48), packed, 30, True)
    wide = rowwise.pack(torch.randn(30, 64).bfloat16())
    assert rowwise.linear_pairs(torch.empty(0, 64), wide, 30, True).shape == (0, 30)


@needs_bf16_pairs
def test_bfloat16_pairs_refuse_what_they_cannot_multiply() -> None:
    with pytest.raises(RuntimeError, match="pairs need a bfloat16 weight of an even width"):
        rowwise.pack(torch.randn(20, 8), pairs=True)
    with pytest.raises(RuntimeError, match="pairs need a bfloat16 weight of an even width"):
        rowwise.pack(torch.randn(20, 7).bfloat16(), pairs=True)
    assert not rowwise.is_pairs(rowwise.pack(torch.randn(20, 7).bfloat16()))  # an odd width is widened
    packed = rowwise.pack(torch.randn(20, 8).bfloat16())
    assert rowwise.linear(torch.empty(0, 8), packed, 20).shape == (0, 20)
    for width, out in ((10, 20), (7, 20), (8, 40), (8, 3)):  # a width or an output count it was not packed for
        with pytest.raises(RuntimeError, match="activations' width and N outputs"):
            rowwise.linear(torch.randn(2, width), packed, out)
    m = matmul(torch.randn(20, 8).bfloat16(), kernel="rowwise")
    assert rowwise.is_pairs(m.weight) and m.rounds  # so the LM head refines its top logits in float32
    assert not matmul(torch.randn(20, 8), kernel="rowwise").rounds


@needs_avx2
def test_the_products_run_without_the_gil() -> None:
    """A drafter's event loop must take a verdict off the network while its compute thread is in a forward:
    another Python thread keeps running through the kernel's calls. With the GIL held there, that thread
    would stop for each whole call: its longest pause would be a call's length."""
    import itertools
    import threading
    import time

    gen = torch.Generator().manual_seed(5)
    packed, x = rowwise.pack(torch.randn(4096, 1536, generator=gen)), torch.randn(256, 1536, generator=gen)
    ticks: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.01)
        spans = []
        for _ in range(3):
            began = time.perf_counter()
            rowwise.linear(x, packed, 4096)
            spans.append((began, time.perf_counter()))
    finally:
        stop.set()
        spinner.join()
    for began, ended in spans:
        inside = [began, *(t for t in ticks if began < t < ended), ended]
        pause = max(b - a for a, b in itertools.pairwise(inside))
        call_ms = (ended - began) * 1e3
        assert pause * 1e3 < 0.5 * call_ms, f"another thread paused {pause * 1e3:.1f} ms of a {call_ms:.1f} ms call"
