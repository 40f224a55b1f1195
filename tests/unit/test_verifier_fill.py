"""Filling and conditional drafts in the verifier's engine core, driven in-process.

Filling: a greedy session whose draft is on its way is decoded target-only by steps with nothing to
verify; its draft's leading tokens are then matched against the fill. Conditional drafts: a draft
sent before the Verdict it assumes (``AddDraft.after``) is the next round's draft exactly when
that Verdict commits its ``after``. Either way, the tokens are the target's greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.verifier.batching import FcfsBatcher
from services.verifier.core_api import AddDraft, AddRequest, Filled, OutOfTurn, Rounded
from services.verifier.fill import Fill, FillBeforeDrafts, make_fill
from services.verifier.requests import Request, Status
from services.verifier.round import filled_outcome, settled_drafts
from shared.models import LoadedModel, load_model
from shared.protocol import SamplingParams
from tests.conftest import greedy_reference
from tests.unit.test_verifier_core import Harness, prompt
from tests.verifier_requests import make_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BUDGET = 3  # the harness's fixed allocation


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["target"])


def started(target: LoadedModel, params: SamplingParams = GREEDY, race: bool = True) -> tuple[Harness, list[int]]:
    """A harness whose speculative session "s" waits for its round-0 draft; the greedy reference."""
    h = Harness(target, race=race)
    p = prompt(5, 9)
    h.core.submit(AddRequest("s", p, params, speculative=True, drafter="edge"))
    h.turn()  # admitted and prefilled: round 0 waits for its draft
    assert h.core.table.requests["s"].status is Status.WAITING_DRAFT
    ref = greedy_reference(target.model, p, params.max_tokens, set())
    head = ref[: 2 * BUDGET + 2]
    assert len(set(head)) == len(head), "a repetitive reference would hide misplaced drafts: pick another prompt"
    return h, ref


def everything(h: Harness, rid: str = "s") -> list[int]:
    """Every token the client got, in order: fills and rounds."""
    return [t for r in h.results if isinstance(r, Filled | Rounded) and r.request_id == rid for t in r.tokens]


# --- filling ------------------------------------------------------------------------------------


def test_a_waiting_greedy_session_is_filled_and_its_draft_matched_against_the_fill(target: LoadedModel) -> None:
    h, ref = started(target)
    h.turn(2)  # nothing to verify: two fill steps
    assert [r.tokens for r in h.of(Filled, "s")] == [ref[0:1], ref[1:2]]  # type: ignore[attr-defined]
    h.core.submit(AddDraft("s", 0, ref[0:BUDGET], None, 0.0))
    h.turn()
    last = h.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded)
    # drafts 0 and 1 were filled already; draft 2 was verified, then the target's own token
    assert (last.round, last.prior, last.tokens) == (0, ref[0:2], ref[2:4])
    assert (last.drafted, last.accepted) == (BUDGET, BUDGET)
    assert everything(h) == ref[:4]


def test_a_draft_that_left_the_fill_verifies_nothing(target: LoadedModel) -> None:
    """The drafts after a mismatch continue a text the target did not write: the round ends with
    one decoding step, the draft judged up to its first mismatch."""
    h, ref = started(target)
    h.turn()  # fills ref[0]
    wrong = (ref[0] + 1) % target.vocab_size
    h.core.submit(AddDraft("s", 0, [wrong, ref[1], ref[2]], None, 0.0))
    h.turn()
    last = h.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded)
    assert (last.prior, last.tokens, last.drafted, last.accepted) == (ref[0:1], ref[1:2], 1, 0)
    assert everything(h) == ref[:2]


def test_a_fill_longer_than_the_draft_accepts_the_draft_and_verifies_nothing(target: LoadedModel) -> None:
    h, ref = started(target)
    h.turn(BUDGET + 1)
    h.core.submit(AddDraft("s", 0, ref[0:BUDGET], None, 0.0))
    h.turn()
    last = h.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded)
    assert (last.prior, last.tokens, last.drafted, last.accepted) == (ref[: BUDGET + 1], ref[BUDGET + 1 : BUDGET + 2],
                                                                      BUDGET, BUDGET)
    assert everything(h) == ref[: BUDGET + 2]


def test_raced_sessions_are_filled_and_stream_sampled_ones_are_not(target: LoadedModel) -> None:
    """A raced token is a function of the text before it (shared.race), so it may be decoded while
    the draft travels; a token from the request's own stream would depend on when it was decoded."""
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    h, _ = started(target, params, race=False)
    h.turn(3)
    assert not h.of(Filled) and h.core.table.requests["s"].status is Status.WAITING_DRAFT
    raced, _ = started(target, params)
    raced.turn(2)
    req = raced.core.table.requests["s"]
    assert req.sampler.race_key is not None and len(raced.of(Filled, "s")) == 2
    fill = list(req.round.fill)
    raced.core.submit(AddDraft("s", 0, fill, None, 0.0))  # a draft that raced like the target
    raced.turn()
    last = raced.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded) and last.accepted == 2 and last.prior == fill


def test_fill_runs_the_session_to_its_end_and_the_round_ends_with_it(target: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    h, ref = started(target, params)
    h.turn(params.max_tokens)
    final = h.of(Rounded, "s")[-1]
    assert isinstance(final, Rounded) and final.finished and final.finish_reason == "length"
    assert final.prior == ref[:2] and everything(h) == ref and "s" not in h.core.table.requests


def test_no_fill_when_a_draft_is_expected_before_the_step_would_end(target: LoadedModel) -> None:
    h, _ = started(target)
    filler = h.core.scheduler.fill
    filler.observe("edge", 3600.0)  # this drafter's drafts come an hour after their verdicts: fill
    h.turn()
    assert len(h.of(Filled, "s")) == 1
    h2, _ = started(target)
    h2.core.scheduler.fill.observe("edge", 10.0)  # ... 10 s after, and this round has waited that long
    h2.core.table.requests["s"].round.waiting_since = time.perf_counter() - 10.0 + 1e-6  # the draft is due...
    h2.core.table.requests["s"].round.number = 1  # ... in a later round: no fill
    h2.turn()
    assert not h2.of(Filled, "s")
    h3, _ = started(target)
    h3.core.scheduler.fill.observe("edge", 10.0)
    h3.core.table.requests["s"].round.waiting_since = time.perf_counter() - 10.0 + 1e-6
    h3.turn()  # round 0's draft comes after the drafter ran the prompt: the verifier decodes on
    assert len(h3.of(Filled, "s")) == 1


@pytest.mark.parametrize(("policy", "fills"), [(make_fill(True), True), (make_fill(True, riders=False), False),
                                               (make_fill(False), False)])
def test_a_waiting_session_rides_along_in_steps_that_verify_others(target: LoadedModel, policy: Fill,
                                                                   fills: bool) -> None:
    """A step that verifies another session runs anyway, so the waiting session gets its token in it
    (with a slow drafter it would get none until its draft came); ``--fill-riders false`` and
    ``--fill false`` add no rider."""
    h, ref = started(target)
    h.core.scheduler.fill = policy
    other = prompt(11, 7)
    h.core.submit(AddRequest("a", other, GREEDY, speculative=False))
    h.turn(4)  # "a": admitted, then verified every step
    assert h.tokens("a") and h.tokens("a") == greedy_reference(target.model, other, 24, set())[:len(h.tokens("a"))]
    if not fills:
        assert not h.of(Filled, "s")
        return
    assert everything(h) == ref[:len(everything(h))] and len(everything(h)) >= 3
    h.core.submit(AddDraft("s", 0, ref[0:BUDGET], None, 0.0))
    h.turn()
    last = h.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded) and (last.drafted, last.accepted) == (BUDGET, BUDGET)
    assert everything(h) == ref[:len(everything(h))]


class _NoRoomForRiders(FcfsBatcher):
    """FCFS whose batches take no rider, as WISP's when any rider would end the step after a deadline."""

    def riders_fit(self, cached: Sequence[int]) -> int:
        return 0


def test_riders_are_only_those_the_batch_policy_fits(target: LoadedModel) -> None:
    """The scheduler asks the batch policy how many riders its batch takes (WISP: within its deadline)."""
    h, _ = started(target)
    h.core.scheduler.batcher = _NoRoomForRiders()
    h.core.submit(AddRequest("a", prompt(11, 7), GREEDY, speculative=False))
    h.turn(4)
    assert h.tokens("a") and not h.of(Filled, "s")


# --- the fill policy's clock ----------------------------------------------------------------------


def waiting(drafter: str, since: float, budget: int = BUDGET, filled: int = 0, round_: int = 1) -> Request:
    req = make_request("r", [1, 2], GREEDY, True, 64, frozenset(), drafter)
    req.status = Status.WAITING_DRAFT
    req.round.waiting_since, req.round.budget, req.round.fill = since, budget, [7] * filled
    req.round.number = round_
    return req


@pytest.mark.parametrize(("waited", "filled", "expected"), [
    (0.0, 0, 1.0),  # due in 1 s
    (0.5, 0, 1.0),  # still due at the same time
    (1.5, 0, 1.5),  # overdue: imminent (expected now)
    (2.5, 0, None),  # late (past twice the typical wait): expected no more
    (0.5, BUDGET - 1, 1.0),
    (0.5, BUDGET, None),  # the fill covers every token the draft may have: it can add nothing
])
def test_when_a_draft_is_expected(waited: float, filled: int, expected: float | None) -> None:
    policy = FillBeforeDrafts()
    policy.observe("edge", 1.0)
    req = waiting("edge", 0.0, filled=filled)
    assert policy.expected(req, waited) == expected
    assert FillBeforeDrafts().expected(req, waited) is None  # never heard from: no expectation


def test_a_sessions_first_draft_is_not_expected_its_drafter_runs_the_prompt_first() -> None:
    policy = FillBeforeDrafts()
    policy.observe("edge", 1.0)
    assert policy.expected(waiting("edge", 0.0, round_=0), 0.5) is None  # the verifier decodes on
    assert policy.next_change([waiting("edge", 0.0, round_=0)], 0.5) is None
    assert policy.expected(waiting("edge", 0.0, round_=1), 0.5) == 1.0


def test_a_draft_is_expected_as_early_as_its_waits_spread() -> None:
    policy = FillBeforeDrafts()
    for wait in (1.0, 2.0, 1.0, 2.0):
        policy.observe("edge", wait)
    mean, dev = policy.waits["edge"]
    assert dev > 0 and policy.expected(waiting("edge", 0.0), 0.0) == pytest.approx(max(0.0, mean - 2 * dev))


def test_the_typical_wait_is_a_moving_average_per_drafter() -> None:
    policy = FillBeforeDrafts()
    # each wait comes back as how far it was from the typical one before it (its metric); None at first
    assert [policy.observe("a", 1.0), policy.observe("a", 2.0), policy.observe("b", 5.0)] == [None, 1.0, None]
    assert policy.waits == {"a": (pytest.approx(1.1), pytest.approx(0.1)), "b": (5.0, 0.0)}
    assert policy.next_change([waiting("a", 0.0), waiting("b", 0.0)], 1.0) == pytest.approx(1.2)  # a turns late


# --- conditional drafts -------------------------------------------------------------------------


def play_round_0(h: Harness, ref: list[int], conditional: AddDraft | None = None) -> None:
    """Round 0 drafts the reference (all accepted: BUDGET + 1 tokens), with ``conditional`` sent after it."""
    h.core.submit(AddDraft("s", 0, ref[0:BUDGET], None, 0.0))
    if conditional is not None:
        h.core.submit(conditional)
    h.turn()


def test_a_conditional_draft_that_came_true_is_the_next_rounds_draft(target: LoadedModel) -> None:
    h, ref = started(target)
    after = tuple(ref[: BUDGET + 1])
    play_round_0(h, ref, AddDraft("s", 1, ref[BUDGET + 1 : 2 * BUDGET + 1], None, 0.0, after=after))
    req = h.core.table.requests["s"]
    assert req.round.number == 1 and req.status is Status.READY  # no wait for the drafter
    h.turn()
    last = h.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded) and (last.round, last.accepted) == (1, BUDGET)
    assert everything(h) == ref[: 2 * BUDGET + 2] and not h.of(OutOfTurn)


def test_a_conditional_draft_whose_verdict_differs_is_dropped_without_a_word(target: LoadedModel) -> None:
    h, ref = started(target)
    wrong = (ref[BUDGET] + 1) % target.vocab_size
    play_round_0(h, ref, AddDraft("s", 1, [5, 6, 7], None, 0.0, after=(*ref[:BUDGET], wrong)))
    assert h.core.table.requests["s"].status is Status.WAITING_DRAFT and not h.of(OutOfTurn)
    h.core.submit(AddDraft("s", 1, ref[BUDGET + 1 : 2 * BUDGET + 1], None, 0.0))  # the drafter drafts afresh
    h.turn()
    assert everything(h) == ref[: 2 * BUDGET + 2] and not h.of(OutOfTurn)


def test_a_conditional_draft_that_crosses_its_verdict_is_taken_if_it_came_true(target: LoadedModel) -> None:
    h, ref = started(target)
    h.core.scheduler.fill.observe("edge", 3600.0)  # fill while the draft travels
    play_round_0(h, ref)
    h.turn()  # round 1 waits: one token filled
    assert h.core.table.requests["s"].round.fill == ref[BUDGET + 1 : BUDGET + 2]
    h.core.submit(AddDraft("s", 1, ref[BUDGET + 1 : 2 * BUDGET + 1], None, 0.0, after=tuple(ref[: BUDGET + 1])))
    stale = AddDraft("s", 0, ref[:BUDGET], None, 0.0, after=(1, 2))  # an older round's: dropped too
    h.core.submit(stale)
    h.turn()
    last = h.of(Rounded, "s")[-1]
    assert isinstance(last, Rounded)
    assert (last.round, last.accepted, last.prior) == (1, BUDGET, ref[BUDGET + 1 : BUDGET + 2])
    assert everything(h) == ref[: 2 * BUDGET + 2] and not h.of(OutOfTurn)


def test_status_says_how_sampled_requests_are_drawn_and_whether_the_verifier_fills(target: LoadedModel) -> None:
    status = Harness(target).core.status()
    assert {k: status[k] for k in ("sampling", "fill")} == {"sampling": "race", "fill": "before-drafts"}
    assert Harness(target, race=False).core.status()["sampling"] == "stream"


def test_a_resuming_drafter_starts_clean(target: LoadedModel) -> None:
    """Attach: the new drafter hears every committed token, so the fill is its base, and the
    conditional drafts its predecessor sent are not its own."""
    h, _ = started(target)
    h.turn()  # one token filled
    req = h.core.table.requests["s"]
    req.round.upcoming.held = [((1, 2), AddDraft("s", 1, [5], None, 0.0, after=(1, 2)))]
    req.detach()
    assert req.attach("edge-2") and req.round.fill == [] and len(req.round.upcoming) == 0
    assert (req.round.draft.sent, req.round.draft.matched) == (0, 0)


def test_a_session_finishing_in_a_fill_counts_its_tokens_once(target: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    h, _ = started(target, params)
    h.turn(params.max_tokens)
    get = h.core.metrics.registry.get_sample_value
    assert get("specfleet_verifier_generated_tokens_total") == get("specfleet_verifier_filled_tokens_total") == 3


@pytest.mark.parametrize(("sent", "filled", "matched", "verified", "accepted", "settled", "outcome"), [
    (4, 0, 0, 4, 2, 0, (4, 2, 2.0)),  # no fill: every draft verified
    (3, 2, 2, 1, 0, 2, (3, 2, 2.0)),  # agreed with both filled tokens: the third verified, rejected
    (3, 2, 1, 0, 0, 3, (2, 1, 1.0)),  # left the fill at its second token: one rejected draft, nothing verified
    (1, 2, 1, 0, 0, 1, (1, 1, 1.0)),  # ran out inside the fill, every draft agreeing with it
    (4, 1, 0, 0, 0, 4, (1, 0, 0.0)),  # left it at once
])
def test_a_filled_rounds_drafts_are_settled_by_the_fill_and_the_round_counted_whole(
        sent: int, filled: int, matched: int, verified: int, accepted: int, settled: int,
        outcome: tuple[int, int, float]) -> None:
    """The arithmetic ``round.draft.settle`` and ``Round.outcome`` use, and the simulator with them."""
    assert settled_drafts(sent, filled, matched) == settled
    assert filled_outcome(filled, matched, sent, verified, accepted, float(accepted)) == outcome
