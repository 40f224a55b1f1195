"""The oracle proposer: the recorded greedy output, each token kept with probability α."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from services.drafter.proposers.base import Continuation, DraftJob, JobSession
from services.drafter.proposers.oracle import OracleProposer, load_references
from shared.protocol import SamplingParams

PROMPT = [5, 6, 7]
REFERENCE = list(range(100, 300))
GREEDY = SamplingParams(temperature=0.0, max_tokens=200)


def job(sid: str, k: int, params: SamplingParams = GREEDY, after: Continuation | None = None) -> DraftJob:
    return DraftJob(JobSession(sid, params, torch.Generator()), k, after=after or Continuation())


def oracle(alpha: float, seed: int = 0) -> OracleProposer:
    return OracleProposer({tuple(PROMPT): REFERENCE}, alpha, vocab_size=1000, seed=seed)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 1.0])
def test_each_position_is_right_with_probability_alpha(alpha: float) -> None:
    """Over many prompts' positions, the share of drafts equal to the reference is α (±4σ)."""
    refs = {(i, i + 1): [(7 * i + j) % 1000 for j in range(50)] for i in range(100)}
    prop = OracleProposer(refs, alpha, vocab_size=1000, seed=3)
    right = total = 0
    for prompt, ref in refs.items():
        prop.start(str(prompt), list(prompt), 50)
        [proposal] = prop.propose([job(str(prompt), 50)])
        right += sum(a == b for a, b in zip(proposal.token_ids, ref, strict=True))
        total += len(ref)
    sigma = (alpha * (1 - alpha) / total) ** 0.5
    assert abs(right / total - alpha) <= 4 * sigma + 1e-9


def test_a_wrong_token_is_never_the_right_one_and_stays_in_the_vocabulary() -> None:
    prop = oracle(0.0)
    prop.start("s", PROMPT, 50)
    [proposal] = prop.propose([job("s", 8)])
    assert all(t != r and 0 <= t < 1000 for t, r in zip(proposal.token_ids, REFERENCE, strict=False))


def test_drafts_follow_the_committed_text_and_are_reproducible() -> None:
    a, b = oracle(0.6, seed=1), oracle(0.6, seed=1)
    for p in (a, b):
        p.start("s", PROMPT, 50)
    first = a.propose([job("s", 4)])[0].token_ids
    assert first == b.propose([job("s", 4)])[0].token_ids
    a.commit("s", REFERENCE[:3], accepted=2)
    assert a.propose([job("s", 4)])[0].token_ids == b._one(job("s", 4, after=Continuation(
        assume=tuple(REFERENCE[:3]), base=len(PROMPT)))).token_ids


@pytest.mark.parametrize("case", ["unknown prompt", "left the reference", "reference ended", "sampled request"])
def test_when_the_oracle_has_nothing_to_offer(case: str) -> None:
    prop = OracleProposer({tuple(PROMPT): REFERENCE}, 0.5, 1000)
    prop.start("s", [1, 2] if case == "unknown prompt" else PROMPT, 50)
    if case == "left the reference":
        prop.commit("s", [REFERENCE[0], 9999], accepted=0)
    if case == "reference ended":
        prop.commit("s", REFERENCE, accepted=0)
    params = SamplingParams(temperature=0.8, max_tokens=10) if case == "sampled request" else GREEDY
    assert prop.propose([job("s", 4, params)])[0].token_ids == []


def test_a_sampled_request_is_drafted_only_by_a_perfect_oracle() -> None:
    prop = oracle(1.0)
    prop.start("s", PROMPT, 50)
    assert prop.propose([job("s", 3, SamplingParams(temperature=0.8, max_tokens=10))])[0].token_ids == REFERENCE[:3]


def test_references_file(tmp_path: Path) -> None:
    good = tmp_path / "refs.jsonl"
    good.write_text(json.dumps({"prompt_ids": PROMPT, "output_ids": REFERENCE[:5]}) + "\n\n")
    assert load_references(good) == {tuple(PROMPT): REFERENCE[:5]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_references(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_references(empty)
    with pytest.raises(ValueError, match="cannot read"):
        load_references(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(("alpha", "vocab"), [(-0.1, 10), (1.5, 10), (0.5, 1)])
def test_bad_settings(alpha: float, vocab: int) -> None:
    with pytest.raises(ValueError):
        OracleProposer({}, alpha, vocab)


@pytest.mark.parametrize(("flags", "message"), [
    ({"proposer": "oracle"}, "--proposer oracle needs --oracle-file"),
    ({"proposer": "oracle", "oracle_file": "refs.jsonl", "oracle_alpha": 1.5}, "--oracle-alpha must be in [0, 1]"),
])
def test_the_drafter_refuses_a_bad_oracle_configuration(flags: dict[str, object], message: str) -> None:
    from services.drafter.config import DrafterConfig
    from services.drafter.main import check_config
    from shared.config import ConfigError, from_flags

    cfg = from_flags(DrafterConfig, model="m", verifier_url="ws://v/v1/drafter", **flags)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(cfg)
