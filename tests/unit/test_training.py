"""The demo-model pipeline's parts on toy sizes: corpus split, tokenizer, training, KL, measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.models import CHAT_TEMPLATE, SPECIAL_TOKENS
from training.batches import WindowSampler, eval_windows
from training.config import Shape, Stage
from training.corpus import Document, build_corpus, code_documents, read_corpus, split_of
from training.distill import kl_loss
from training.loop import lr_at, run_stage
from training.measure import greedy_round_lengths, heldout_loss, pair_stats, spec_round_stats
from training.tokenizer import encode_corpus, train_tokenizer
from training.train import build_model, ce_loss

torch.set_num_threads(1)
TOY = Shape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, max_positions=128)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few real stdlib files plus two docs-like documents, about 150 kB."""
    docs = [d for _, d in zip(range(12), code_documents(), strict=False)]
    docs += [Document(f"pydoc_data/topics.py::t{i}", "docs", "The assert statement checks a condition.\n" * 40)
             for i in range(2)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    build_corpus(path, heldout_percent=30, docs=docs)
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return train_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=400, limit_bytes=200_000)


@pytest.fixture(scope="module")
def stream(corpus: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    out = tmp_path_factory.mktemp("tokens")
    encode_corpus(corpus, tokenizer, out)
    return np.concatenate([np.load(out / "train_code.npy"), np.load(out / "heldout_code.npy")])


def test_split_is_by_file_disjoint_and_deterministic(tmp_path: Path) -> None:
    docs = [Document(f"pkg/mod{i}.py", "code", f"x = {i}\n") for i in range(200)]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    build_corpus(first, 10, docs)
    build_corpus(second, 10, list(reversed(docs)))
    split_a = {r["name"]: r["split"] for r in read_corpus(first)}
    split_b = {r["name"]: r["split"] for r in read_corpus(second)}
    assert split_a == split_b  # order of discovery does not matter
    held = {n for n, s in split_a.items() if s == "heldout"}
    train = {n for n, s in split_a.items() if s == "train"}
    assert held and train and not held & train and held | train == set(split_a)
    assert 5 <= len(held) <= 40  # about 10 % of 200
    assert all(split_of(n, 10) == s for n, s in split_a.items())


def test_real_stdlib_corpus_excludes_tests() -> None:
    names = [d.name for _, d in zip(range(200), code_documents(), strict=False)]
    assert names and all("/test/" not in f"/{n}" and not n.startswith("test/") for n in names)


@pytest.mark.parametrize("text", ["def f(x):\n    return x ** 2  # é ✓\n", "\t\tcls = type('A', (), {})\n\n", ""])
def test_tokenizer_round_trips(tokenizer: Any, text: str) -> None:
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_tokenizer_has_chat_template_and_specials(tokenizer: Any) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    for special in SPECIAL_TOKENS:
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer.eos_token == "<|end|>"


def test_toy_training_lowers_loss(tokenizer: Any, stream: np.ndarray, tmp_path: Path) -> None:
    sampler = WindowSampler(stream, stream, seq_len=32, docs_weight=0.0, seed=0)
    model = build_model(TOY, tokenizer, seed=0)
    probe = eval_windows(stream, 8, 32)
    before = heldout_loss(model.eval(), probe)
    run_stage("toy", model, ce_loss, sampler, Stage(steps=20, batch=8, lr=3e-3, warmup=2), tmp_path / "ck", 10)
    assert heldout_loss(model, probe) < before - 0.5


def test_resumed_run_matches_uninterrupted(tokenizer: Any, stream: np.ndarray, tmp_path: Path) -> None:
    sampler = WindowSampler(stream, stream, seq_len=16, docs_weight=0.0, seed=3)
    whole = build_model(TOY, tokenizer, seed=0)
    run_stage("whole", whole, ce_loss, sampler, Stage(steps=6, batch=4, lr=1e-3, warmup=2), tmp_path / "a", 3)
    parted = build_model(TOY, tokenizer, seed=0)
    run_stage("part", parted, ce_loss, sampler, Stage(steps=6, batch=4, lr=1e-3, warmup=2, max_minutes=1e-9),
              tmp_path / "b", 3)  # stops at once: nothing trained yet
    (tmp_path / "b" / "done.json").unlink()
    run_stage("part", parted, ce_loss, sampler, Stage(steps=6, batch=4, lr=1e-3, warmup=2), tmp_path / "b", 3)
    for a, b in zip(whole.state_dict().values(), parted.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


def test_batches_depend_only_on_seed_and_step(stream: np.ndarray) -> None:
    a = WindowSampler(stream, stream, 16, 0.5, seed=1)
    b = WindowSampler(stream, stream, 16, 0.5, seed=1)
    assert torch.equal(a.batch(5, 4), b.batch(5, 4))
    assert not torch.equal(a.batch(5, 4), a.batch(6, 4))


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    stage = Stage(steps=100, batch=1, lr=1.0, warmup=10)
    assert lr_at(0, stage) == pytest.approx(0.1)
    assert lr_at(10, stage) == pytest.approx(1.0)
    assert lr_at(100, stage) == pytest.approx(0.1)


def test_kl_is_zero_for_identical_logits_and_matches_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 3, 7, generator=gen), torch.randn(2, 3, 7, generator=gen)
    assert float(kl_loss(t, t)) == pytest.approx(0.0, abs=1e-6)
    p, q = t.softmax(-1), s.softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert float(kl_loss(t, s)) == pytest.approx(float(expected), rel=1e-5)
    assert float(kl_loss(t, s)) > 0


@pytest.mark.parametrize(
    ("matches", "k", "expected"),
    [
        ([True] * 10, 4, [4, 4]),  # 4 accepted + bonus, twice
        ([False] * 3, 4, [0, 0, 0]),
        ([True, True, False, True, True, True, True, True], 4, [2, 4]),
        ([True, True, False, True, True, True, True, True, False], 4, [2, 4, 0]),
        ([True] * 3, 4, [3]),  # runs out of text mid-round
    ],
)
def test_greedy_round_lengths(matches: list[bool], k: int, expected: list[int]) -> None:
    assert greedy_round_lengths(matches, k) == expected


def test_identical_models_agree_and_accept_fully(tokenizer: Any, stream: np.ndarray) -> None:
    model = build_model(TOY, tokenizer, seed=5).eval()
    twin = build_model(TOY, tokenizer, seed=5).eval()
    stats = pair_stats(model, twin, eval_windows(stream, 4, 32))
    assert stats.greedy_agreement == 1.0
    assert stats.acceptance_t1 == pytest.approx(1.0, abs=1e-5)
    rounds = spec_round_stats(model, twin, eval_windows(stream, 2, 15)[:, :16], new_tokens=10, k=4)
    assert rounds["mean_accepted"] == 4.0 and rounds["tokens_per_round"] == 5.0


def test_different_models_accept_less(tokenizer: Any, stream: np.ndarray) -> None:
    a = build_model(TOY, tokenizer, seed=1).eval()
    b = build_model(TOY, tokenizer, seed=2).eval()
    stats = pair_stats(a, b, eval_windows(stream, 2, 32))
    assert 0.0 < stats.acceptance_t1 < 1.0
