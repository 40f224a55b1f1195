"""``python -m bench draft-rounds``: its guess count by hand, and a teacher-forced answer drafted round by
round on a tiny draft, counted once, the prompt's prefill left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.draft_rounds import guess_counts, one_answer
from shared.models import LoadedModel
from shared.next_tokens import NextTokens
from shared.protocol import SamplingParams
from tests.unit.draft_proposer_support import make, reference_greedy, tiny_draft

torch.set_num_threads(1)


def test_the_guess_count_by_hand(tmp_path: Path) -> None:
    """Positions 2-6 of 5 6 7 5 6 7 5: lookup matches at 5 and 6 (both right); the table (5 6 -> 7, 5 -> 6)
    guesses at 2 and 4 (both right) and has nothing after 7 at 3."""
    table = tmp_path / "t.next-tokens.json"
    table.write_text(json.dumps(NextTokens.build([[5, 6, 7], [5, 6, 7]]).to_json()))
    got = guess_counts([[5, 6, 7, 5, 6, 7, 5]], table)
    assert got == {"positions": 5, "lookup_share": 0.4, "lookup_right": 1.0, "table_share": 0.4, "table_right": 1.0,
                   "table_tokens_a_position": 0.4}


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_draft(tmp_path_factory)


@pytest.mark.parametrize("agrees", [True, False])
def test_an_answer_is_drafted_round_by_round_to_its_end(draft: LoadedModel, agrees: bool) -> None:
    """An answer the draft agrees with takes ceil(n / (k + 1)) rounds of k forwards; one it never agrees
    with, a round of k forwards a token (each round's draft rejected at once). Only the timed pass counts,
    without the prompt's prefill."""
    prompt, k = [200, 14], 3
    mine = reference_greedy(draft, prompt, 12)
    answer = mine if agrees else [next(t for t in range(draft.vocab_size) if t not in mine)] * 12
    proposer = make(draft)
    live = {"forwards": 0, "rows": 0}
    forward = proposer.runner.forward

    def counting(segments: list) -> torch.Tensor | None:  # type: ignore[type-arg]
        live["forwards"] += 1
        return forward(segments)

    proposer.runner.forward = counting  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    one_answer(proposer, "warm", prompt, answer, k, greedy, live, None)
    totals = {"forwards": 0.0, "rows": 0.0, "seconds": 0.0, "committed": 0.0}
    one_answer(proposer, "timed", prompt, answer, k, greedy, live, totals)
    assert totals["committed"] == 12 and totals["seconds"] > 0
    assert totals["forwards"] == (3 * k if agrees else 12 * k)
    assert live["forwards"] == 2 * (totals["forwards"] + 1)  # both passes, each with its prefill
