"""The grammar's masks on a verified round: row j allows what the grammar allows after drafts
0..j-1, the matcher is back where it was afterwards, and only committed tokens advance it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.verifier.grammar import GrammarError, Grammars
from services.verifier.judge import judge
from shared.models import LoadedModel, load_model
from shared.protocol import SamplingParams, Structured
from tests.verifier_requests import make_request

CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["target"])


@pytest.fixture(scope="module")
def grammars(target: LoadedModel) -> Grammars:
    return Grammars(target.tokenizer, target.vocab_size)


def ids(target: LoadedModel, text: str) -> list[int]:
    return list(target.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_round_masks_equal_masks_after_each_prefix(target: LoadedModel, grammars: Grammars) -> None:
    spec = Structured(kind="choice", spec=json.dumps(CHOICES))
    drafts = ids(target, "green")
    round_masks = grammars.matcher(spec).masks(drafts)
    for j in range(len(drafts) + 1):
        alone = grammars.matcher(spec)
        alone.advance(drafts[:j])
        assert torch.equal(round_masks[j], alone.masks([])[0]), f"row {j}"
    assert round_masks[-1].nonzero().flatten().tolist() == sorted(target.eos_ids)  # "green" is complete


def test_masks_leave_the_state_alone_and_stop_at_a_refused_draft(target: LoadedModel, grammars: Grammars) -> None:
    spec = Structured(kind="choice", spec=json.dumps(CHOICES))
    grammar = grammars.matcher(spec)
    before = grammar.masks([])[0]
    bad = ids(target, "x")[0]
    rows = grammar.masks([bad, *ids(target, "red")])
    assert not rows[0, bad] and rows[1:].all()  # rows after a refused draft are never read
    assert torch.equal(grammar.masks([])[0], before)


def test_greedy_round_under_a_grammar_commits_only_allowed_tokens(target: LoadedModel, grammars: Grammars) -> None:
    spec = Structured(kind="regex", spec="[0-9]{3}")
    params = SamplingParams(temperature=0.0, structured=spec)
    req = make_request("r", ids(target, "x = "), params, True, 512, frozenset(target.eos_ids))
    req.sampler.grammar = grammars.matcher(spec)
    out: list[int] = []
    for _ in range(8):
        logits = torch.randn(1, target.vocab_size, generator=torch.Generator().manual_seed(len(out)))
        verdict = judge([(req, [])], logits)[0]
        out += req.commit(verdict.tokens)
        if req.finish_reason:
            break
    text = target.tokenizer.decode(out, skip_special_tokens=True)
    assert len(text) == 3 and text.isdigit() and out[-1] in target.eos_ids


@pytest.mark.parametrize("spec", [Structured(kind="regex", spec="(unclosed"),
                                  Structured(kind="json_schema", spec='{"type": "nonsense"}')])
def test_unusable_grammars_are_refused_with_the_reason(grammars: Grammars, spec: Structured) -> None:
    with pytest.raises(GrammarError, match=spec.kind):
        grammars.matcher(spec)
