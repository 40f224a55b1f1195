"""The committed drafts of SmolLM2-135M-Instruct: what they are, what they measured, and that the
fleet stays lossless with them (greedy identity is in test_smollm2.py; here, sampling at T = 1)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

from services.coordinator.model_info import ModelInfo
from shared.models import load_model
from shared.protocol import SamplingParams
from shared.sampling import probs_from_logits
from tests.conftest import invariant_logits
from tests.e2e.greedy_streams import metric_value
from tests.e2e.lossless_stats import chi_square_p
from tests.e2e.stack import StackSpec, run_stack
from tests.e2e.test_full_stack import stream_many
from tests.real.conftest import FULL, READY_S, ROOT, VERIFIER_FLAGS

pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]
DRAFT_BUDGET_BYTES = 32 * 1000 * 1000
SAMPLES = 500


@pytest.fixture(scope="module")
def report() -> dict:  # type: ignore[type-arg]
    return json.loads((ROOT / "models" / "MEASUREMENTS.json").read_text())


def test_two_drafts_share_the_targets_tokenizer(smollm2: Path, committed_drafts: list[Path]) -> None:
    assert [p.name for p in committed_drafts] == ["draft-large", "draft-small"]
    target = load_model(smollm2)
    for path in committed_drafts:
        draft = load_model(path)
        assert draft.fingerprint == target.fingerprint and draft.model.config.model_type == "specfleet_llama"
        config = json.loads((path / "config.json").read_text())
        assert config["dtype"] == "bfloat16" and list(path.glob("*.safetensors"))


def test_the_drafts_fit_their_budget(committed_drafts: list[Path]) -> None:
    total = sum(f.stat().st_size for p in committed_drafts for f in p.glob("*.safetensors"))
    assert total <= DRAFT_BUDGET_BYTES, f"the drafts hold {total:,} bytes, over {DRAFT_BUDGET_BYTES:,}"


def test_cards_carry_the_measured_numbers(committed_drafts: list[Path], report: dict) -> None:  # type: ignore[type-arg]
    for path in committed_drafts:
        card, measured = (path / "README.md").read_text(), report["models"][path.name]
        assert f"greedy agreement with the target: {measured['greedy_agreement']:.3f}" in card
        assert "Apache-2.0" in card and "make demo-models" in card


@pytest.mark.parametrize("draft", ["Q4_1", "draft-large"] if FULL else ["Q4_1"])
def test_sampling_at_t1_through_a_draft_is_the_targets_law(smollm2: Path, committed_drafts: list[Path],
                                                           tmp_path: Path, draft: str) -> None:
    """The first verified position, 500 seeded requests: chi-square against the target's p. The
    draft is the large distilled one, or the target's Q4_1 GGUF copy on llama.cpp (it agrees often:
    the verifier's rejection rule, not the draft, must make the law the target's)."""
    from shared.gguf_copies import copy_path

    target = load_model(smollm2)
    messages = [{"role": "user", "content": "Name one colour."}]
    ids = ModelInfo.load(str(smollm2)).encode_chat(messages)  # as the coordinator encodes the request
    p1 = probs_from_logits(invariant_logits(target, ids), SamplingParams(temperature=1.0))
    body = {"kind": "chat", "model": target.name, "messages": messages, "max_tokens": 2, "temperature": 1.0,
            "ignore_eos": True}
    path = committed_drafts[0] if draft == "draft-large" else copy_path(smollm2, draft)
    # no fill: the verifier waits for each request's first draft rather than decode its first token alone
    # while the drafter prefills the prompt (llama.cpp's prefill on a CPU takes longer than that token)
    spec = StackSpec(drafts=[path], max_sessions=8, extra_verifier=[*VERIFIER_FLAGS, "--fill", "false"],
                     ready_timeout_s=READY_S)
    with run_stack(smollm2, spec, tmp_path) as stack:
        for attempt in range(2):  # a correct sampler fails alpha = 0.01 once in 100; twice, 1e-4
            seeds = range(attempt * SAMPLES, (attempt + 1) * SAMPLES)
            results = asyncio.run(stream_many(stack, [{**body, "seed": s} for s in seeds]))
            p = chi_square_p(Counter(r[0][0] for r in results), p1.tolist(), SAMPLES)
            if p > 0.01:
                break
        metrics = httpx.get(stack.base_url + "/metrics").text
    accepted = metric_value(metrics, "specfleet_coordinator_accepted_tokens_total")
    assert accepted > 0, "no draft was accepted: the test would prove nothing"
    assert p > 0.01, p
    assert torch.isclose(p1.sum(), torch.tensor(1.0), atol=1e-4)
