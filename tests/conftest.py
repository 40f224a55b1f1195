"""Shared fixtures: tiny models (made once per run), free ports, reference decoding."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from shared.models import make_tiny_family
from tests.redis_fixture import *  # noqa: F403  (the real redis-server fixture: redis_url)

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random tiny Llama target + drafts sharing one tokenizer (see shared.models)."""
    cached = os.environ.get("SPECFLEET_TEST_MODELS")
    root = Path(cached) if cached else tmp_path_factory.mktemp("tiny-models")
    return make_tiny_family(root, seed=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@torch.inference_mode()
def greedy_reference(model: torch.nn.Module, prompt_ids: list[int], max_new: int, eos_ids: set[int]) -> list[int]:
    """Target-only greedy decoding, recomputing the whole context each step: the ground truth."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token in eos_ids:
            break
    return out
