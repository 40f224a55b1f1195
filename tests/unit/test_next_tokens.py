"""The next-token table (``shared.next_tokens``): what it guesses, its file, where a drafter finds it,
and a draft step that feeds its guess in the step's free row: the draft is the one drafting token by
token gives, with a forward saved for every guess the draft model drafts too."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from services.drafter.config import DrafterConfig
from services.drafter.main import check_config, next_tokens_table
from services.drafter.proposers.base import DraftJob, JobSession
from shared.config import ConfigError
from shared.errors import ModelLoadError
from shared.gguf_copies import make_table, table_path
from shared.models import LoadedModel
from shared.next_tokens import NextTokens, load_table, table_beside, write_table
from tests.unit.draft_proposer_support import FULL_GREEDY, gen, make, reference_greedy, tiny_draft
from tests.unit.test_draft_lookup_rows import Counting

torch.set_num_threads(1)


@pytest.mark.parametrize(("corpus", "context", "want"), [
    ([[1, 2, 3], [1, 2, 3], [1, 2, 4]], [1, 2], 3),  # the pair's commonest follower
    ([[1, 2, 3], [5, 2, 4], [5, 2, 4]], [1, 2], 4),  # a pair seen once: its last token's
    ([[1, 2, 4], [1, 2, 3]], [1, 2], 3),  # a tie: the smaller id
    ([[7, 8, 9], [7, 8, 9]], [6, 8], 9),  # an unseen pair backs off to its last token
    ([[7, 8, 9]], [8], 9),  # one token of context
    ([[7, 8, 9]], [9], None),  # nothing ever followed it
    ([[7, 8, 9]], [], None),
])
def test_the_table_guesses_the_commonest_follower(corpus: list[list[int]], context: list[int],
                                                  want: int | None) -> None:
    assert NextTokens.build(corpus).guess(context) == want


def test_a_table_file_round_trips_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    answers = tmp_path / "train.jsonl.gz"
    with gzip.open(answers, "wt") as f:
        for i, answer in enumerate([[1, 2, 3], [1, 2, 3], [4, 2, 5]]):
            f.write(json.dumps({"id": str(i), "mode": "greedy", "answer": answer}) + "\n")
    made = write_table(answers, tmp_path / "t.next-tokens.json")
    read = load_table(tmp_path / "t.next-tokens.json")
    assert (read.pairs, read.singles) == (made.pairs, made.singles) == ({(1, 2): 3}, {1: 2, 2: 3, 4: 2})
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ModelLoadError, match="not a next-token table"):
        load_table(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text(json.dumps({"format": "specfleet-next-tokens-1", "pairs": [[1]]}))
    with pytest.raises(ModelLoadError, match="malformed"):
        load_table(tmp_path / "broken.json")
    (tmp_path / "negative.json").write_text(json.dumps({"format": "specfleet-next-tokens-1", "pairs": [[1, 2, -3]],
                                                        "singles": []}))
    with pytest.raises(ModelLoadError, match="negative token id"):
        load_table(tmp_path / "negative.json")
    (tmp_path / "x.gguf").write_bytes(b"GGUF\x03\x00\xff\xfe\x80")  # a GGUF given by mistake
    with pytest.raises(ModelLoadError, match="cannot read the next-token table"):
        load_table(tmp_path / "x.gguf")


def test_a_missing_table_file_is_refused_with_the_flag_to_fix(tmp_path: Path) -> None:
    cfg = DrafterConfig()
    cfg.draft_model.model, cfg.draft_model.next_tokens = "some-draft", str(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="--next-tokens must be auto, off or a table file"):
        check_config(cfg)


def test_a_drafter_finds_the_table_beside_its_gguf_copy(tmp_path: Path) -> None:
    copy = tmp_path / "smollm2-135m-instruct.Q4_1.gguf"
    assert table_beside(copy) == tmp_path / "smollm2-135m-instruct.next-tokens.json"
    assert table_beside(tmp_path / "target.gguf") == tmp_path / "target.next-tokens.json"  # the k8s volume's
    for name, table in [("Llama-3.2-1B.gguf", "Llama-3.2-1B"), ("qwen2.5-0.5b.Q8_0.GGUF", "qwen2.5-0.5b"),
                        ("m.IQ4_NL.gguf", "m"), ("m.BF16.gguf", "m")]:
        assert table_beside(tmp_path / name) == tmp_path / f"{table}.next-tokens.json"  # only a width is cut
    assert next_tokens_table("auto", copy, 100) is None  # none made: no guesses, no error
    table_beside(copy).write_text(json.dumps(NextTokens.build([[1, 2, 3]]).to_json()))
    auto = next_tokens_table("auto", copy, 100)
    assert auto is not None and auto.guess([1, 2]) == 3
    assert next_tokens_table("off", copy, 100) is None
    assert next_tokens_table("auto", None, 100) is None  # a draft model directory has no table beside it
    named = next_tokens_table(str(table_beside(copy)), None, 100)
    assert named is not None and named.guess([2]) == 3
    with pytest.raises(ModelLoadError, match="token id 3, outside the draft's vocabulary of 3"):
        next_tokens_table("auto", copy, 3)  # a table made for another model


def test_fetch_model_makes_the_table_from_the_committed_answers(tmp_path: Path) -> None:
    target = tmp_path / "smollm2-135m-instruct"
    make_table(target)  # the real committed answers of the default target
    table = load_table(table_path(target))
    assert len(table.pairs) > 10_000 and len(table.singles) > 5_000
    (tmp_path / "no-answers").mkdir()
    make_table(tmp_path / "no-answers")  # a target with no committed answers: no table, no error
    assert not table_path(tmp_path / "no-answers").exists()


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_draft(tmp_path_factory)


PROMPT = [200, 14]


@pytest.mark.parametrize("right", [True, False])
def test_a_tables_guess_saves_a_forward_when_right_and_never_changes_a_draft(draft: LoadedModel,
                                                                            right: bool) -> None:
    """A table built from the model's own continuation guesses right wherever lookup has no match; one
    built from other text guesses wrong. Either way the draft is the model's own."""
    want = reference_greedy(draft, PROMPT, 12)
    plain, tabled = make(draft, lookup_rows=3), make(draft, lookup_rows=3)
    if right:
        tabled.next_tokens = NextTokens.build([[*PROMPT, *want]], min_pair_count=1)
    else:  # every guess a token the draft never drafts
        never = next(t for t in range(draft.vocab_size) if t not in want)
        tabled.next_tokens = NextTokens({}, dict.fromkeys(range(draft.vocab_size), never))
    counts = {}
    for proposer in (plain, tabled):
        proposer.start("s", PROMPT, 64)
        counts[proposer] = Counting(proposer)
        assert proposer.propose([DraftJob(JobSession("s", FULL_GREEDY, gen(0)), 12)])[0].token_ids == want
    assert tabled.table_guesses > 0 and (tabled.table_kept > 0) is right
    # every draft token comes from a forward of its own or from a kept guess's row
    saved = tabled.looked_up_kept - plain.looked_up_kept
    assert counts[tabled].forwards == counts[plain].forwards - saved
    assert saved > 0 if right else saved == 0


def test_a_step_of_several_sessions_feeds_no_table_guess(draft: LoadedModel) -> None:
    """Its rows are already more than one: a guessed row would cost its share of the step."""
    p = make(draft, lookup_rows=3)
    p.next_tokens = NextTokens.build([[*PROMPT, *reference_greedy(draft, PROMPT, 12)]], min_pair_count=1)
    for s in ("a", "b"):
        p.start(s, PROMPT, 64)
    drafts = p.propose([DraftJob(JobSession(s, FULL_GREEDY, gen(0)), 6) for s in ("a", "b")])
    assert [d.token_ids for d in drafts] == [reference_greedy(draft, PROMPT, 6)] * 2
    assert p.table_guesses == 0
