"""Live prefix sharing: the common-prefix helper, the arena's row copy, and the core serving n
requests with one prompt (or one system prompt) by computing the shared rows once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.verifier.core_api import AddRequest, Rounded
from shared.models import LoadedModel, load_model
from shared.prefix import common_prefix_len
from shared.protocol import SamplingParams
from shared.runner.kv import KVArena, KVError, KVShape
from tests.conftest import greedy_reference
from tests.unit.test_verifier_core import GREEDY, Harness, prompt


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["target"])


@pytest.mark.parametrize(("a", "b", "n"), [([], [], 0), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1, 9], 1), ([4], [5], 0),
                                           ([1], [], 0), ([7, 7, 7], [7, 7, 7], 3)])
def test_common_prefix_len(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix_len(a, b) == common_prefix_len(b, a) == n


def test_common_prefix_len_agrees_with_a_plain_scan() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == want


def test_share_copies_only_the_rows_the_destination_lacks() -> None:
    arena = KVArena(KVShape(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32), 64 * 2 * 2 * 4 * 4)
    src, dst = arena.allocate(20), arena.allocate(20)
    assert src is not None and dst is not None
    arena.data[:, :, :, src.start : src.start + 12] = torch.randn(2, 2, 1, 12, 4)
    src.length = 12
    arena.data[:, :, :, dst.start : dst.start + 3] = 7.0  # dst's own rows: kept as they are
    dst.length = 3
    arena.share(src, dst, 10)
    assert dst.length == 10
    rows = arena.data[:, :, :, dst.start : dst.start + 10]
    assert bool((rows[..., :3, :] == 7.0).all())
    assert torch.equal(rows[..., 3:, :], arena.data[:, :, :, src.start + 3 : src.start + 10])
    with pytest.raises(KVError, match="cannot share 13 rows: the source holds 12"):
        arena.share(src, dst, 13)
    with pytest.raises(KVError, match="cannot share 5 rows"):
        arena.share(src, dst, 5)  # shorter than what dst holds


def run_together(target: LoadedModel, prompts: list[list[int]], share: bool) -> Harness:
    h = Harness(target, prefill_chunk=32, share_prefixes=share)
    for i, p in enumerate(prompts):
        h.core.submit(AddRequest(f"r{i}", p, GREEDY, speculative=False))
    h.turn(60)
    for i, p in enumerate(prompts):
        assert h.tokens(f"r{i}") == greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
        assert h.of(Rounded, f"r{i}")[-1].finished  # type: ignore[attr-defined]
    assert h.runner.kv.reserved_tokens == 0
    return h


def computed_prompt_rows(h: Harness) -> float:
    return h.core.metrics.prefill_tokens._value.get()


def test_n_requests_with_one_prompt_compute_it_once(target: LoadedModel) -> None:
    """Four sessions of one 120-token prompt (what n=4 opens): the prompt's rows are computed
    once and copied three times; every output is still the reference. Without sharing, each
    session computes them."""
    p = prompt(5, 120)
    shared = run_together(target, [p] * 4, share=True)
    alone = run_together(target, [p] * 4, share=False)
    assert shared.core.metrics.shared_tokens._value.get() >= 3 * 100
    assert alone.core.metrics.shared_tokens._value.get() == 0
    assert computed_prompt_rows(shared) < computed_prompt_rows(alone) / 2


def test_a_shared_system_prompt_is_copied_and_the_rest_computed(target: LoadedModel) -> None:
    system = prompt(6, 48)
    prompts = [system + prompt(10 + i, 20) for i in range(3)]
    h = run_together(target, prompts, share=True)
    assert h.core.metrics.shared_tokens._value.get() >= 2 * 40


def test_short_or_different_prompts_share_nothing(target: LoadedModel) -> None:
    h = run_together(target, [prompt(i, 30) for i in range(3)] + [prompt(7, 10)] * 2, share=True)
    assert h.core.metrics.shared_tokens._value.get() == 0


def test_a_sampled_n_keeps_independent_outputs(target: LoadedModel) -> None:
    """Shared rows change nothing of the sampling: two seeded sampled sessions of one prompt
    produce what each produces with sharing off."""
    p = prompt(8, 64)
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in (1, 2)]

    def outputs(share: bool) -> list[list[int]]:
        h = Harness(target, prefill_chunk=32, share_prefixes=share)
        for i, sp in enumerate(params):
            h.core.submit(AddRequest(f"s{i}", p, sp, speculative=False))
        h.turn(60)
        return [h.tokens(f"s{i}") for i in range(2)]

    assert outputs(True) == outputs(False)
