"""The GGUF proposer: a tiny draft written as GGUF by the tests, run by llama.cpp, honours the
proposer contract (greedy = argmax decoding, batches = each session alone, rollback = a fresh
cache, sampled q exact, raced drafts, branches in spare sequences, a full cache refused), and a
GGUF reads its own vocabulary, stop tokens and shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.drafter.control.base import StepDecision
from services.drafter.proposers.base import EMPTY_PROPOSAL, Continuation, DraftJob, JobSession
from services.drafter.proposers.gguf import GgufProposer, gguf_draft
from shared.draft_q import Nucleus, read
from shared.gguf_files import gguf_file, read_gguf
from shared.models import LoadedModel, ModelLoadError, load_model
from shared.protocol import SamplingParams
from shared.race import top_two
from shared.runner import Segment
from shared.runner.kv import KVError
from shared.runner.llama import LlamaRunner
from shared.sampling import probs_from_logits
from tests.unit.draft_proposer_support import (
    BATCH_PROMPTS,
    FULL_GREEDY,
    GREEDY,
    PROMPT,
    WARM,
    StopAt,
    gen,
    reference_greedy,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def draft_path(tiny_ggufs: dict[str, Path]) -> Path:
    return tiny_ggufs["draft-L1"]


@pytest.fixture(scope="module")
def hf_draft(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["draft-L1"])


def make(path: Path, budget: int = MiB, sequences: int = 16, **kwargs: object) -> GgufProposer:
    info = read_gguf(path)
    return GgufProposer(LlamaRunner(info, budget, threads=1, sequences=sequences), info, **kwargs)  # type: ignore[arg-type]


def one(p: GgufProposer, sid: str, k: int, params: SamplingParams = GREEDY, seed: int = 0,
        race_key: int | None = None) -> list[int]:
    (proposal,) = p.propose([DraftJob(JobSession(sid, params, gen(seed), race_key=race_key), k)])
    return proposal.token_ids


def llama_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """The last position's logits from a fresh llama.cpp context: the reference for numerics."""
    runner = LlamaRunner(read_gguf(path), MiB, threads=1)
    slot = runner.kv.allocate(len(ids) + 1)
    assert slot is not None
    logits = runner.forward([Segment(slot, ids, len(ids) - 1)])
    assert logits is not None
    return logits[-1]


# --- the file -------------------------------------------------------------------------------------

def test_a_gguf_carries_the_vocabulary_stop_tokens_and_shape_of_its_model(draft_path: Path,
                                                                          hf_draft: LoadedModel) -> None:
    info = read_gguf(draft_path)
    assert info.vocabulary.fingerprint == hf_draft.fingerprint  # the same token ids: a verifier admits it
    assert info.eos_ids == frozenset(hf_draft.eos_ids)
    assert (info.layers, info.context_length, info.file_type) == (1, 512, "F32")
    assert gguf_draft(info).vocab_size == hf_draft.vocab_size
    assert gguf_file(draft_path) == draft_path and gguf_file(draft_path.parent / "missing-dir") is None


def test_a_foreign_gguf_has_another_vocabulary(tiny_ggufs: dict[str, Path], hf_draft: LoadedModel) -> None:
    foreign = read_gguf(tiny_ggufs["foreign"]).vocabulary
    assert hf_draft.vocabulary is not None
    assert foreign.fingerprint != hf_draft.fingerprint
    assert foreign.ids_fingerprint != hf_draft.vocabulary.ids_fingerprint
    assert foreign.summary.startswith(f"{foreign.size} tokens, eos ")


@pytest.mark.parametrize("damage", ["truncate", "not-gguf", "missing"])
def test_a_damaged_gguf_is_refused_with_one_clear_line(draft_path: Path, tmp_path: Path, damage: str) -> None:
    bad = tmp_path / "bad.gguf"
    if damage == "truncate":
        bad.write_bytes(draft_path.read_bytes()[:2000])
    elif damage == "not-gguf":
        bad.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ModelLoadError, match=r"truncated|not a GGUF|does not exist"):
        read_gguf(bad)


# --- drafting -------------------------------------------------------------------------------------

def test_greedy_proposal_is_argmax_decoding(draft_path: Path, hf_draft: LoadedModel) -> None:
    p = make(draft_path)
    p.start("s", PROMPT, 64)
    (proposal,) = p.propose([DraftJob(JobSession("s", FULL_GREEDY, gen(0)), 6)])
    assert proposal.token_ids == reference_greedy(hf_draft, PROMPT, 6)
    assert proposal.q is None and len(proposal.runner_up) == 6


@pytest.mark.parametrize(("accepted", "with_bonus"), [(0, True), (2, True), (5, True), (1, False)])
def test_rollback_drafts_what_a_fresh_context_drafts(draft_path: Path, hf_draft: LoadedModel, accepted: int,
                                                     with_bonus: bool) -> None:
    p = make(draft_path)
    p.start("s", PROMPT, 64)
    first = one(p, "s", 5, FULL_GREEDY)
    bonus = [(first[accepted] + 1) % hf_draft.vocab_size] if accepted < 5 else [17]
    new = first[:accepted] + (bonus if with_bonus else [])
    p.commit("s", new, accepted)
    after = one(p, "s", 5, FULL_GREEDY)
    fresh = make(draft_path)
    fresh.start("f", PROMPT + new, 64)
    assert after == one(fresh, "f", 5, FULL_GREEDY) == reference_greedy(hf_draft, PROMPT + new, 5)
    assert p.cached_tokens("s") == len(PROMPT) + len(new) + 4  # the rejected drafts left the sequence


def test_one_context_drafts_many_sessions_each_as_if_it_were_alone(draft_path: Path, hf_draft: LoadedModel) -> None:
    batched = make(draft_path)
    for sid, prompt in BATCH_PROMPTS.items():
        batched.start(sid, prompt, 64)
    ks = {"a": 5, "b": 2, "c": 7}
    got = batched.propose([DraftJob(JobSession(sid, FULL_GREEDY, gen(0)), k) for sid, k in ks.items()])
    for sid, proposal in zip(ks, got, strict=True):
        assert proposal.token_ids == reference_greedy(hf_draft, BATCH_PROMPTS[sid], ks[sid])
    # different rollbacks, then the sessions in another order
    new = {sid: [*p.token_ids[:1], 3] for sid, p in zip(ks, got, strict=True)}
    for sid in ks:
        batched.commit(sid, new[sid], 1)
    got = batched.propose([DraftJob(JobSession(sid, FULL_GREEDY, gen(0)), 4) for sid in ("c", "a", "b")])
    for sid, proposal in zip(("c", "a", "b"), got, strict=True):
        assert proposal.token_ids == reference_greedy(hf_draft, [*BATCH_PROMPTS[sid], *new[sid]], 4)
    batched.close("b")
    assert batched.propose([DraftJob(JobSession("b", GREEDY, gen(0)), 3)]) == [EMPTY_PROPOSAL]


def test_a_sampled_draft_carries_the_exact_q_it_was_drawn_from(draft_path: Path) -> None:
    p = make(draft_path, nucleus=Nucleus(mass=1.0, max_entries=4096))
    p.start("s", PROMPT, 64)
    (proposal,) = p.propose([DraftJob(JobSession("s", WARM, gen(5)), 1)])
    assert proposal.q is not None and len(proposal.q) == 1
    ids, q = read(proposal.q[0])
    want = probs_from_logits(llama_logits(draft_path, PROMPT), WARM)
    dense = torch.zeros_like(want, dtype=torch.float64).index_put_((ids,), q)
    torch.testing.assert_close(dense, want.double(), rtol=2e-3, atol=1e-6)  # q travels in float16
    assert proposal.token_ids[0] in ids.tolist()
    again = make(draft_path, nucleus=Nucleus(mass=1.0, max_entries=4096))
    again.start("s", PROMPT, 64)
    assert one(again, "s", 1, WARM, seed=5) == proposal.token_ids  # the session's stream decides the draw


def test_a_raced_request_drafts_the_winner_of_its_race(draft_path: Path) -> None:
    p = make(draft_path)
    p.start("s", PROMPT, 64)
    (proposal,) = p.propose([DraftJob(JobSession("s", WARM, gen(0), race_key=1234), 1)])
    winner, runner_up = top_two(probs_from_logits(llama_logits(draft_path, PROMPT), WARM), 1234, len(PROMPT))
    assert proposal.token_ids == [winner] and proposal.runner_up == [runner_up] and proposal.q is None
    other = make(draft_path)
    other.start("s", PROMPT, 64)
    assert one(other, "s", 4, WARM, race_key=1234) == one(other, "s", 4, WARM, race_key=1234)  # no randomness drawn


def test_a_branch_drafts_in_a_spare_sequence_and_becomes_the_main_one_when_it_comes_true(
        draft_path: Path, hf_draft: LoadedModel) -> None:
    p = make(draft_path)
    p.start("s", PROMPT, 64)
    (sent,) = p.propose([DraftJob(JobSession("s", FULL_GREEDY, gen(0)), 4)])
    assume = (*sent.token_ids[:1], sent.runner_up[1])
    main, branch = p.propose([
        DraftJob(JobSession("s", FULL_GREEDY, gen(0)), 5, after=Continuation(tuple(sent.token_ids), len(PROMPT))),
        DraftJob(JobSession("s", FULL_GREEDY, gen(0)), 4, after=Continuation(assume, len(PROMPT), branch=1))])
    assert main.token_ids == reference_greedy(hf_draft, PROMPT + sent.token_ids, 5)
    assert branch.token_ids == reference_greedy(hf_draft, [*PROMPT, *assume], 4)
    p.commit("s", list(assume), 1)  # the branch came true
    assert one(p, "s", 4, FULL_GREEDY) == branch.token_ids


def test_a_session_the_context_has_no_room_for_drafts_nothing(draft_path: Path) -> None:
    info = read_gguf(draft_path)
    p = make(draft_path, budget=256 * info.kv_bytes_per_token, sequences=2)  # 256 cells in all
    p.start("big", PROMPT, 150)  # fits: 7 + 150 + 64 drafts
    p.start("second", PROMPT, 150)  # no room left: drafts nothing, the session is not refused
    assert len(one(p, "big", 3)) == 3 and one(p, "second", 3) == []
    p.close("big")
    p.start("third", PROMPT, 150)
    assert len(one(p, "third", 3)) == 3  # the closed session's cells and sequence were given back


def test_a_token_outside_the_vocabulary_is_refused_by_the_runner(draft_path: Path) -> None:
    runner = LlamaRunner(read_gguf(draft_path), MiB, threads=1)
    slot = runner.kv.allocate(8)
    assert slot is not None
    with pytest.raises(KVError, match="outside the draft's vocabulary"):
        runner.forward([Segment(slot, [1, 10**6], 1)])


def test_a_feed_longer_than_one_decode_goes_in_several_with_the_same_logits(draft_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp takes at most its batch size per decode: a long feed (a prompt's first draft) is cut
    into several, the rows asked for in an early one kept, the positions running on."""
    import shared.runner.llama as llama

    ids = [*PROMPT, *BATCH_PROMPTS["b"]]
    whole = LlamaRunner(read_gguf(draft_path), MiB, threads=1)
    slot = whole.kv.allocate(len(ids))
    assert slot is not None
    want = whole.forward([Segment(slot, ids, 2)])
    monkeypatch.setattr(llama, "BATCH_TOKENS", 4)
    cut = LlamaRunner(read_gguf(draft_path), MiB, threads=1)
    assert cut.batch_tokens == 4
    slot = cut.kv.allocate(len(ids))
    assert slot is not None
    got = cut.forward([Segment(slot, ids, 2)])
    assert got is not None and want is not None and got.shape == want.shape == (len(ids) - 2, whole.vocab_size)
    assert slot.length == len(ids)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("decision", "kept"), [(StepDecision.STOP, 3), (StepDecision.DISCARD, 2)])
def test_a_controller_reads_each_tokens_features_and_stops_the_draft(draft_path: Path, decision: StepDecision,
                                                                     kept: int) -> None:
    p = make(draft_path)
    p.start("s", PROMPT, 64)
    controller = StopAt(2, decision)
    (proposal,) = p.propose([DraftJob(JobSession("s", FULL_GREEDY, gen(0)), 6, controller=controller)])
    assert len(proposal.token_ids) == kept and proposal.final
    assert [s.position for s in controller.seen] == [0, 1, 2]
    assert all(0.0 < s.top1_prob <= 1.0 and s.token_prob == s.top1_prob for s in controller.seen)  # greedy
    assert all(s.spread.entropy > 0 for s in controller.seen)


@pytest.mark.parametrize(("prompt", "shared"), [
    ([*PROMPT[:-1], 90, 91, 92], len(PROMPT) - 1),  # the whole prompt but its last token
    ([*PROMPT, 90], len(PROMPT)),  # a's cache holds its whole prompt (and drafts): all of b's but its last
    ([*PROMPT[:3], 90, 91, 92, 93], 0),  # fewer than MIN_SHARED_PREFIX tokens in common: nothing
])
def test_a_first_draft_takes_the_prompt_rows_another_session_holds(draft_path: Path, hf_draft: LoadedModel,
                                                                    prompt: list[int], shared: int) -> None:
    """Sessions with a common system prompt: the second one's first draft tags the first one's cells
    (no prefill of them), drafts what it drafts alone, and keeps drafting once the first has closed."""
    p = make(draft_path)
    p.start("a", PROMPT, 64)
    one(p, "a", 3, FULL_GREEDY)
    p.start("b", prompt, 64)
    assert one(p, "b", 4, FULL_GREEDY) == reference_greedy(hf_draft, prompt, 4)
    assert p.shared_prefix_tokens == shared
    p.close("a")  # kept for its cells, until another closed session takes its place: a's tags go
    p.start("c", [200, 14, 3], 64)
    one(p, "c", 2)
    p.close("c")
    p.commit("b", [5], 0)
    assert one(p, "b", 4, FULL_GREEDY) == reference_greedy(hf_draft, [*prompt, 5], 4)
