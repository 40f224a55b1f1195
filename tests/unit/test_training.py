"""The draft pipeline's parts on a tiny teacher: prompts, answers, top-k, distillation, resume, measures.

The tiny random target of the test family plays the teacher; the pipeline end to end (answers,
their committed gzip, the teacher's distributions, two factorised drafts, export, evaluation,
model cards) runs in seconds, and an interrupted distillation resumes to the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.factorised import FactorisedLlamaForCausalLM
from shared.models import load_model
from shared.runner import ModelRunner, Segment
from training.__main__ import main as training_main
from training.config import Stage, toy_settings
from training.data import committed_path, read_committed, sequences, write_committed
from training.distill import AnswerBatches, build_draft, soft_ce, svd_table
from training.evaluate import greedy_round_lengths, pair_stats
from training.loop import lr_at, run_stage
from training.prompts import build_prompts, split_prompts
from training.teacher import TeacherPlan, generate_answers, read_answers
from training.teacher_logits import teacher_topk

torch.set_num_threads(1)


def test_prompts_are_seeded_diverse_and_split_by_topic() -> None:
    prompts = build_prompts(seed=0)
    assert [p.id for p in prompts] == [p.id for p in build_prompts(seed=0)]
    assert {p.kind for p in prompts} >= {"question", "code", "maths", "summary", "rewrite", "list", "story"}
    held, train = split_prompts(prompts, "heldout"), split_prompts(prompts, "train")
    assert 0.03 < len(held) / len(prompts) < 0.15 and not {p.id for p in held} & {p.id for p in train}
    topic = "photosynthesis"  # a topic's prompts all fall on one side
    assert len({p.split for p in prompts if topic in p.text}) == 1


def test_answers_resume_and_are_deterministic(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    prompts = split_prompts(build_prompts(), "train")[:6]
    plan = TeacherPlan(max_new_tokens=8, batch=3, token_budget=10**6)
    whole = tmp_path / "whole.jsonl"
    generate_answers(target, prompts, whole, plan, kv_budget_bytes=1 << 22)
    part = tmp_path / "part.jsonl"
    generate_answers(target, prompts[:2], part, plan, kv_budget_bytes=1 << 22)
    part.write_text(part.read_text() + '{"id": "torn')  # an interrupted write
    generate_answers(target, prompts, part, plan, kv_budget_bytes=1 << 22)
    by_id = {r["id"]: r for r in read_answers(whole)}
    assert {r["id"]: r for r in read_answers(part)} == by_id and len(by_id) == 6
    assert {r["mode"] for r in by_id.values()} == {"greedy", "t0.8"}
    assert all(1 <= len(r["answer"]) <= 8 for r in by_id.values())


def test_committed_answers_round_trip_with_stable_bytes(tmp_path: Path) -> None:
    records = [{"id": "a", "mode": "greedy", "answer": [1, 2, 3]}]
    path = committed_path(tmp_path, "m", "train")
    write_committed(records, path)
    first = path.read_bytes()
    write_committed(records, path)
    assert path.read_bytes() == first and read_committed(path) == records


def test_topk_is_the_teachers_distribution(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    prompts = split_prompts(build_prompts(), "train")[:3]
    records = [{"id": p.id, "mode": "greedy", "answer": [5, 6, 7, 8]} for p in prompts]
    seqs = sequences(records, prompts, target.tokenizer)
    top = teacher_topk(target, seqs, tmp_path / "topk", k=5)
    assert teacher_topk(target, seqs, tmp_path / "topk", k=5)[seqs[0].id].ids.tolist() == top[seqs[0].id].ids.tolist()
    seq = seqs[1]
    with torch.no_grad():
        full = target.model(input_ids=torch.tensor([seq.ids[:-1]])).logits[0, len(seq.prompt) - 1 :]
    want = torch.log_softmax(full.float(), -1).topk(5, -1)
    assert torch.equal(top[seq.id].ids.long(), want.indices)
    assert torch.allclose(top[seq.id].logprobs.float(), want.values, atol=2e-2)


def test_unknown_answers_are_an_error(tiny_models: dict[str, Path]) -> None:
    target = load_model(tiny_models["target"])
    with pytest.raises(ValueError, match="belong to no prompt"):
        sequences([{"id": "nope", "answer": [1]}], build_prompts(), target.tokenizer)


def test_svd_table_keeps_the_embeddings_geometry() -> None:
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(50, 4, generator=gen) @ torch.randn(4, 16, generator=gen)
    table = svd_table(low_rank, 4)
    assert table.shape == (50, 4)
    gram, want = table @ table.T, low_rank @ low_rank.T
    assert torch.allclose(gram / gram.norm(), want / want.norm(), atol=1e-4)


def test_a_draft_runs_on_the_lean_runner(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    settings = toy_settings(str(tiny_models["target"]), tmp_path / "s", tmp_path / "m", tmp_path / "d")
    target = load_model(tiny_models["target"])
    draft = build_draft(settings.drafts["draft-small"], target.tokenizer, target.model, seed=0)
    draft.save_pretrained(str(tmp_path / "draft"))
    target.tokenizer.save_pretrained(str(tmp_path / "draft"))
    loaded = load_model(tmp_path / "draft")
    assert isinstance(loaded.model, FactorisedLlamaForCausalLM) and loaded.fingerprint == target.fingerprint
    runner = ModelRunner(loaded, 1 << 22, kind="auto")  # checks itself against transformers
    assert runner.kind == "lean"
    slot = runner.kv.allocate(8)
    assert slot is not None and runner.forward([Segment(slot, [3, 4, 5], 0)]) is not None


def _batches(tiny_models: dict[str, Path], tmp_path: Path) -> tuple[object, AnswerBatches, object]:
    target = load_model(tiny_models["target"])
    prompts = split_prompts(build_prompts(), "train")[:8]
    out = tmp_path / "answers.jsonl"
    generate_answers(target, prompts, out, TeacherPlan(max_new_tokens=10, batch=8), kv_budget_bytes=1 << 22)
    seqs = sequences(read_answers(out), prompts, target.tokenizer)
    topk = teacher_topk(target, seqs, tmp_path / "topk", k=8)
    return target, AnswerBatches(seqs, topk, seed=0, pad_id=0), seqs


def test_distillation_lowers_the_loss_and_resumes_exactly(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target, batches, _ = _batches(tiny_models, tmp_path)
    settings = toy_settings(str(tiny_models["target"]), tmp_path / "s", tmp_path / "m", tmp_path / "d")
    shape, stage = settings.drafts["draft-small"], Stage(steps=8, batch_tokens=200, lr=3e-3, warmup=2)
    assert torch.equal(batches.batch(3, 200)["input_ids"], batches.batch(3, 200)["input_ids"])
    whole = build_draft(shape, target.tokenizer, target.model, seed=0)  # type: ignore[attr-defined]
    with torch.no_grad():
        before = float(soft_ce(whole, batches.batch(0, 200)))
    run_stage("whole", whole, soft_ce, batches, stage, tmp_path / "a", 3)
    with torch.no_grad():
        assert float(soft_ce(whole, batches.batch(0, 200))) < before
    parted = build_draft(shape, target.tokenizer, target.model, seed=0)  # type: ignore[attr-defined]
    interrupted = Stage(steps=8, batch_tokens=200, lr=3e-3, warmup=2, max_minutes=1e-9)
    run_stage("part", parted, soft_ce, batches, interrupted, tmp_path / "b", 3)  # stops at once
    run_stage("part", parted, soft_ce, batches, stage, tmp_path / "b", 3)  # stopped early: continues
    for a, b in zip(whole.state_dict().values(), parted.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    assert run_stage("whole", whole, soft_ce, batches, stage, tmp_path / "a", 3).steps == 8  # done: skipped
    longer = Stage(steps=10, batch_tokens=200, lr=3e-3, warmup=2)
    assert run_stage("whole", whole, soft_ce, batches, longer, tmp_path / "a", 3).steps == 10  # a longer budget


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    stage = Stage(steps=100, batch_tokens=1, lr=1.0, warmup=10)
    assert lr_at(0, stage) == pytest.approx(0.1)
    assert lr_at(10, stage) == pytest.approx(1.0)
    assert lr_at(100, stage) == pytest.approx(0.1)


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


def test_a_model_agrees_with_itself_on_its_greedy_answers(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    prompts = split_prompts(build_prompts(), "heldout")[:4]
    out = tmp_path / "held.jsonl"
    generate_answers(target, prompts, out, TeacherPlan(max_new_tokens=10, batch=4, sample_every=0),
                     kv_budget_bytes=1 << 22)
    stats = pair_stats(target.model, target.model, sequences(read_answers(out), prompts, target.tokenizer))
    assert stats["greedy_agreement"] == 1.0 and stats["accept_t1"] == pytest.approx(1.0, abs=1e-4)
    assert stats["mean_accepted_k4"] > 1.0


def test_the_pipeline_end_to_end_on_a_tiny_teacher(tiny_models: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = ["all", "--toy", "--target", str(tiny_models["target"]), "--state-dir", str(tmp_path / "state"),
            "--out-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data"), "--threads", "1"]
    assert training_main(args) == 0
    assert "draft-large: agreement" in capsys.readouterr().out
    name = tiny_models["target"].name
    assert committed_path(tmp_path / "data", name, "train").exists()
    assert committed_path(tmp_path / "data", name, "heldout").exists()
    report = json.loads((tmp_path / "models" / "MEASUREMENTS.json").read_text())
    assert set(report["models"]) == {"draft-large", "draft-small"}
    for draft in ("draft-large", "draft-small"):
        card = (tmp_path / "models" / draft / "README.md").read_text()
        assert "greedy agreement" in card and "Apache-2.0" in card
        assert load_model(tmp_path / "models" / draft).fingerprint == load_model(tiny_models["target"]).fingerprint
    # a second run resumes every stage: nothing is trained again, the measurements are redone
    assert training_main(args) == 0
    assert training_main(["eval", *args[1:]]) == 0
