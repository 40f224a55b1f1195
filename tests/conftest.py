"""Shared fixtures: tiny models (made once per run), free ports, reference decoding."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from shared.models import LoadedModel, make_tiny_family
from shared.runner import ModelRunner, Segment
from shared.runner.runner import kv_shape
from tests.redis_fixture import *  # noqa: F403  (the real redis-server fixture: redis_url)

torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=os.environ.get("SPECFLEET_TEST_DEVICE", "cpu"),
                     help="torch device for the tests marked 'device' (cpu; the GPU check passes cuda)")


def pytest_configure(config: pytest.Config) -> None:
    import tests.unit.runner_models as runner_models

    device = str(config.getoption("--device"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: torch {torch.__version__} sees no CUDA device here")
    runner_models.DEVICE = device


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random tiny Llama target + drafts sharing one tokenizer (see shared.models)."""
    cached = os.environ.get("SPECFLEET_TEST_MODELS")
    root = Path(cached) if cached else tmp_path_factory.mktemp("tiny-models")
    return make_tiny_family(root, seed=0)


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny family as GGUF files llama.cpp runs (float32, ``shared.gguf_write``): ``draft-L1``,
    ``target`` (the target's own copy: it agrees with it), and ``foreign``: a draft of another
    family, whose vocabulary is not the target's."""
    from shared.gguf_write import write_llama_gguf

    root = tmp_path_factory.mktemp("tiny-gguf")
    other = make_tiny_family(root / "other-family", seed=1, vocab_size=300)
    return {"draft-L1": write_llama_gguf(tiny_models["draft-L1"], root / "draft-L1.gguf"),
            "target": write_llama_gguf(tiny_models["target"], root / "target.gguf"),
            "foreign": write_llama_gguf(other["draft-L1"], root / "foreign.gguf")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@torch.inference_mode()
def greedy_reference(model: torch.nn.Module, prompt_ids: list[int], max_new: int, eos_ids: set[int]) -> list[int]:
    """Target-only greedy decoding by transformers itself, one token a step over its own KV cache
    (as ``generate`` decodes): the ground truth, independent of specfleet's runner."""
    out: list[int] = []
    step = torch.tensor([list(prompt_ids)])
    past = None
    for _ in range(max_new):
        result = model(step, past_key_values=past, use_cache=True)
        past = result.past_key_values
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        step = torch.tensor([[token]])
    return out


def _invariant_runner(loaded: LoadedModel, tokens: int, matmul: str = "auto") -> ModelRunner:
    rows = -(-tokens // 64) * 64 + 3 * 64  # the prompt's slot, plus the three of the invariance self-check
    return ModelRunner(loaded, rows * kv_shape(loaded.model).bytes_per_token, kind="lean",
                       self_check=False, batch_invariant=True, matmul=matmul)


@torch.inference_mode()
def invariant_logits(loaded: LoadedModel, prompt_ids: list[int]) -> torch.Tensor:
    """The next-token logits after ``prompt_ids`` as a batch-invariant verifier computes them."""
    runner = _invariant_runner(loaded, len(prompt_ids))
    slot = runner.kv.allocate(len(prompt_ids))
    assert slot is not None
    logits = runner.forward([Segment(slot, prompt_ids, len(prompt_ids) - 1)])
    assert logits is not None
    return logits[-1]


@torch.inference_mode()
def invariant_greedy(loaded: LoadedModel, prompt_ids: list[int], max_new: int, matmul: str = "auto") -> list[int]:
    """Target-only greedy decoding as a batch-invariant verifier computes it (its logits do not depend
    on the step's shape, so this is the verifier's own target-only text, in the model's dtype, on the
    ``matmul`` kernel the verifier runs)."""
    runner = _invariant_runner(loaded, len(prompt_ids) + max_new, matmul)
    slot = runner.kv.allocate(len(prompt_ids) + max_new)
    assert slot is not None
    logits = runner.forward([Segment(slot, prompt_ids, len(prompt_ids) - 1)])
    out: list[int] = []
    while logits is not None and len(out) < max_new:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in loaded.eos_ids:
            break
        logits = runner.forward([Segment(slot, [token], 0)])
    return out


#: the tiers in the order a run takes them: the pure ones first, so that ``make test`` can run lint
#: and the smoke run beside them (scripts/test.sh) before the tiers that start services and time faults
TIER_ORDER = ("unit", "stat")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def tier(item: pytest.Item) -> int:
        parts = item.path.relative_to(tests).parts if item.path.is_relative_to(tests) else ()
        return TIER_ORDER.index(parts[0]) if parts and parts[0] in TIER_ORDER else len(TIER_ORDER)

    items.sort(key=tier)  # stable: each tier keeps its own order
