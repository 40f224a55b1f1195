"""ModelRunner.forward against transformers' plain forward, for each Llama-family variant and
both runner kinds: prefill, decode, chunks, packed multi-session steps, rollback.

The reference is always a full forward of the whole sequence with no cache, on an untouched
copy of the model, so the runner's KV arena, positions, masks and row selection are all checked.
"""

from __future__ import annotations

import pytest
import torch

from shared.runner import KVError, ModelRunner, Segment
from tests.unit.runner_models import (
    ARCHS,
    DEVICE,
    KV_BUDGET,
    assert_close,
    full_logits,
    make_runner,
    rel_err,
    tiny_model,
    token_ids,
)

KINDS = ["lean", "hf"]
pytestmark = pytest.mark.device  # on --device (the GPU check runs them on cuda)


@pytest.fixture(params=list(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_decode_token_by_token(arch: str, kind: str) -> None:
    runner, ref = make_runner(arch, kind)
    ids = token_ids(24)
    want = full_logits(ref, ids)
    slot = runner.kv.allocate(32)
    assert slot is not None
    assert_close(runner.forward([Segment(slot, ids[:9], 0)]), want[:9])  # one-shot prefill, every row
    assert slot.length == 9
    for i in range(9, 24):
        got = runner.forward([Segment(slot, [ids[i]], 0)])
        assert got is not None and got.shape == (1, runner.vocab_size)
        assert_close(got, want[i : i + 1])
    assert slot.length == 24


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_in_chunks(arch: str, kind: str) -> None:
    runner, ref = make_runner(arch, kind)
    ids = token_ids(30, seed=1)
    want = full_logits(ref, ids)
    slot = runner.kv.allocate(30)  # exactly full at the end
    assert slot is not None
    start = 0
    for size, logits_from in [(7, 7), (1, 1), (10, 9), (5, 0), (6, 3), (1, 0)]:
        got = runner.forward([Segment(slot, ids[start : start + size], logits_from)])
        if logits_from == size:
            assert got is None  # a prefill chunk asks for no logits
        else:
            assert_close(got, want[start + logits_from : start + size])
        start += size
        assert slot.length == start
    assert slot.room == 0


def _prefill(runner: ModelRunner, ids: list[int], capacity: int) -> Segment:
    """A slot holding ``ids`` (prefilled alone, no logits); returns an empty-logits segment handle."""
    slot = runner.kv.allocate(capacity)
    assert slot is not None
    if ids:
        assert runner.forward([Segment(slot, ids, len(ids))]) is None
    return Segment(slot, [], 0)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_step_over_sessions_of_different_lengths(arch: str, kind: str) -> None:
    runner, ref = make_runner(arch, kind)
    # (cached tokens, new tokens, logits_from) per session: decode, multi-token verify, a prefill
    # chunk with no logits, a fresh prompt, a draft block scored from its second row.
    shapes = [(10, 1, 0), (3, 6, 2), (5, 4, 4), (0, 7, 0), (15, 3, 1)]
    seqs = [token_ids(past + new, seed=10 + i) for i, (past, new, _) in enumerate(shapes)]
    slots = [_prefill(runner, seq[:past], 24).slot for seq, (past, _, _) in zip(seqs, shapes, strict=True)]
    segments = [Segment(slot, seq[past:], lf) for slot, seq, (past, _, lf) in zip(slots, seqs, shapes, strict=True)]
    got = runner.forward(segments)
    want = torch.cat([full_logits(ref, seq)[past + lf :] for seq, (past, _, lf) in zip(seqs, shapes, strict=True)])
    assert got is not None and got.shape == (1 + 4 + 0 + 7 + 2, runner.vocab_size)
    assert_close(got, want)  # rows in segment order, each segment's rows in token order
    assert [s.length for s in slots] == [past + new for past, new, _ in shapes]

    # The next step in the opposite order: rows come back in the new segment order.
    nxt = token_ids(len(slots), seed=99)
    got = runner.forward([Segment(slot, [t], 0) for slot, t in zip(reversed(slots), reversed(nxt), strict=True)])
    want = torch.stack([full_logits(ref, [*seq, t])[-1] for seq, t in zip(seqs, nxt, strict=True)])
    assert_close(got, want.flip(0))


@pytest.mark.parametrize("kind", KINDS)
def test_packed_step_logit_row_selection(kind: str) -> None:
    runner, ref = make_runner("llama", kind)
    seqs = [token_ids(n, seed=20 + n) for n in (5, 8, 3)]
    wants = [full_logits(ref, seq) for seq in seqs]

    def step(logits_from: list[int]) -> torch.Tensor | None:
        slots = [runner.kv.allocate(8) for _ in seqs]
        try:
            return runner.forward([Segment(slot, seq, lf)
                                   for slot, seq, lf in zip(slots, seqs, logits_from, strict=True)])
        finally:
            for slot in slots:
                runner.kv.free(slot)

    assert step([5, 8, 3]) is None  # nobody wants logits
    assert_close(step([0, 0, 0]), torch.cat(wants))  # every row (no index_select)
    assert_close(step([4, 8, 0]), torch.cat([wants[0][4:], wants[2]]))
    assert_close(step([5, 2, 2]), torch.cat([wants[1][2:], wants[2][2:]]))
    assert runner.kv.sessions == 0


@pytest.mark.parametrize("kind", KINDS)
def test_batched_scoring_equals_scoring_each_session_alone(arch: str, kind: str) -> None:
    runner, _ = make_runner(arch, kind)
    prompts = [token_ids(n, seed=30 + n) for n in (2, 11, 6, 1)]
    steps = [token_ids(n, seed=40 + n) for n in (3, 1, 5, 2)]  # then decode one token each
    decode = token_ids(len(prompts), seed=50)

    def run(together: bool) -> list[torch.Tensor]:
        slots = [runner.kv.allocate(20) for _ in prompts]
        out: list[torch.Tensor] = []
        for feed in (prompts, steps, [[t] for t in decode]):
            segments = [Segment(slot, tokens, 0) for slot, tokens in zip(slots, feed, strict=True)]
            if together:
                logits = runner.forward(segments)
                assert logits is not None
                out.extend(logits.split([len(tokens) for tokens in feed]))
            else:
                out.extend(runner.forward([seg]) for seg in segments)
        return out

    alone, together = run(False), run(True)
    assert len(alone) == len(together) == 12
    for a, b in zip(alone, together, strict=True):
        assert rel_err(b, a) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_then_different_tokens_is_a_fresh_sequence(arch: str, kind: str) -> None:
    runner, ref = make_runner(arch, kind)
    prompt, replacement, accepted = token_ids(9, seed=60), token_ids(4, seed=61), 7
    results = []
    for rejected in (token_ids(4, seed=62), token_ids(4, seed=63)):  # two different rejected drafts
        drafts = [accepted, *rejected]
        slot = runner.kv.allocate(20)
        assert slot is not None
        runner.forward([Segment(slot, prompt, len(prompt))])
        runner.forward([Segment(slot, drafts, 0)])  # a verification step: all drafts cached
        assert slot.length == 14
        slot.truncate(10)  # keep the first draft, forget four
        results.append(runner.forward([Segment(slot, replacement, 0)]))
    # The forgotten keys/values differ between the two runs but no longer matter, bit for bit.
    assert results[0] is not None and results[1] is not None
    assert torch.equal(results[0], results[1])
    fresh = full_logits(ref, [*prompt, accepted, *replacement])
    assert_close(results[0], fresh[10:])


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_into_the_prompt_and_reuse_of_a_slot(kind: str) -> None:
    runner, ref = make_runner("qwen2", kind)
    first, second = token_ids(12, seed=70), token_ids(9, seed=71)
    slot = runner.kv.allocate(16)
    assert slot is not None
    runner.forward([Segment(slot, first, 0)])
    slot.truncate(4)  # back into the prompt
    got = runner.forward([Segment(slot, second[4:], 0)])
    assert_close(got, full_logits(ref, first[:4] + second[4:])[4:])
    slot.truncate(0)  # a whole new sequence in the same rows
    assert_close(runner.forward([Segment(slot, second, 0)]), full_logits(ref, second))


@pytest.mark.parametrize("kind", KINDS)
def test_unwritten_arena_rows_are_never_read(kind: str) -> None:
    runner, ref = make_runner("llama-bias", kind)
    runner.kv.data.fill_(float("nan"))  # torch.empty may hold anything; NaN would spread to every logit
    ids = token_ids(10, seed=80)
    slot = runner.kv.allocate(40)
    assert slot is not None
    got = torch.cat([runner.forward([Segment(slot, ids[:6], 0)]),
                     runner.forward([Segment(slot, ids[6:], 0)])])
    assert bool(torch.isfinite(got).all())
    assert_close(got, full_logits(ref, ids))


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_step_changes_nothing(kind: str) -> None:
    runner, _ = make_runner("llama", kind)
    a, b = runner.kv.allocate(8), runner.kv.allocate(4)
    assert a is not None and b is not None
    with pytest.raises(KVError, match="overflows"):
        runner.forward([Segment(a, [1, 2], 0), Segment(b, [1, 2, 3, 4, 5], 0)])
    with pytest.raises(KVError, match="logits_from"):
        runner.forward([Segment(a, [1, 2], 3)])
    assert (a.length, b.length) == (0, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_model(kind: str) -> None:
    runner, ref = make_runner("qwen3", kind, dtype=torch.bfloat16)
    ids = token_ids(12, seed=90)
    slot = runner.kv.allocate(12)
    # on a CPU, bfloat16 weights run with float32 activations, and so a float32 KV cache
    assert slot is not None and runner.kv.data.dtype == torch.float32 and runner.weight_dtype == torch.bfloat16
    assert runner.shape.bytes_per_token == 2 * 2 * 2 * 32 * 4  # layers, k+v, kv heads, head_dim, 4 bytes
    assert runner.describe()["activations"] == "float32" and runner.describe()["dtype"] == "bfloat16"
    got = torch.cat([runner.forward([Segment(slot, ids[:7], 0)]),
                     runner.forward([Segment(slot, ids[7:], 0)])])
    assert got.dtype == torch.float32
    assert_close(got, full_logits(ref, ids), rtol=5e-2)


def test_bfloat16_activations_can_be_asked_for() -> None:
    """What the fidelity benchmark compares against: bfloat16 all through, as before float32 activations."""
    loaded = tiny_model("llama")
    loaded.model.to(torch.bfloat16)
    runner = ModelRunner(loaded, KV_BUDGET, kind="lean", activations=torch.bfloat16)
    assert runner.kv.data.dtype == torch.bfloat16 and runner.describe()["activations"] == "bfloat16"
    slot = runner.kv.allocate(6)
    assert slot is not None
    got = runner.forward([Segment(slot, token_ids(6, seed=3), 0)])
    assert got is not None and got.dtype == torch.float32
    assert_close(got, full_logits(loaded.model, token_ids(6, seed=3)), rtol=5e-2)


def test_the_rotary_table_is_bitwise_what_the_module_makes_per_step(arch: str) -> None:
    """The lean decoder reads its rotary rows from a table (``LeanDecoder._rope``): each row must be
    bitwise the model's rotary module's own for a step's positions, however the table grew."""
    runner, _ = make_runner(arch, "lean")
    decoder = runner.decoder
    x = torch.zeros(1, 4, device=DEVICE, dtype=decoder.adtype)  # the module reads its dtype and device
    for positions in ([0], [5, 6, 7], [3, 1029, 2100], list(range(40, 57))):
        pos = torch.tensor(positions, device=DEVICE)
        cos, sin = decoder._rope(x, pos)
        want_cos, want_sin = decoder.rotary(x, pos.unsqueeze(0))
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0] * decoder.rot_sign)
    assert decoder._cos.shape[0] >= 2101
