"""The verifier's engine core, driven in-process: scheduling, chunked prefill, KV admission, rounds.

The core runs synchronously here (``_iterate``), so every assertion is about what one loop
turn does; the socket-level behaviour is tested in tests/integration/test_verifier.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.verifier.allocation import Allocator, FixedAllocator, GoodputTracker, RoundStats
from services.verifier.batching import BatchLimits, FcfsBatcher
from services.verifier.batching.estimator import StepTimeEstimator
from services.verifier.core import CoreLimits, TorchCore
from services.verifier.core_api import (
    AddDraft,
    AddRequest,
    Admitted,
    Carried,
    Detach,
    Detached,
    DraftAsks,
    Finish,
    OutOfTurn,
    RequestRefused,
    Result,
    Rounded,
)
from services.verifier.metrics import VerifierMetrics
from services.verifier.requests import Status
from services.verifier.scheduler import Scheduler
from services.verifier.trim import ConfidenceTrim, TrimPolicy, make_trim
from services.verifier.trim.confidence import GAP_ALPHA, MAX_GAP_S, PROBE_EVERY
from shared.models import LoadedModel, load_model
from shared.protocol import SamplingParams
from shared.runner import ModelRunner
from shared.runner.runner import kv_shape
from tests.conftest import greedy_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
IDLE_S = 0.3  # a pause between requests
assert IDLE_S < MAX_GAP_S


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["target"])


class Harness:
    def __init__(self, target: LoadedModel, kv_tokens: int = 4096, prefill_chunk: int = 256,
                 max_batch_tokens: int = 2048, max_waiting: int = 8, draft_timeout_s: float = 60.0,
                 allocator: Allocator | None = None, trim: TrimPolicy | None = None,
                 estimator: StepTimeEstimator | None = None, recompute_context: bool = False,
                 share_prefixes: bool = True, race: bool = True) -> None:
        per_token = kv_shape(target.model).bytes_per_token
        self.runner = ModelRunner(target, kv_tokens * per_token, self_check=False)
        self.results: list[Result] = []
        self.core = TorchCore(self.runner, target.eos_ids, allocator or FixedAllocator(3),
                              Scheduler(FcfsBatcher(), BatchLimits(32, max_batch_tokens), prefill_chunk, estimator,
                                        trim),
                              CoreLimits(8, draft_timeout_s, max_waiting, recompute_context=recompute_context,
                                         share_prefixes=share_prefixes, race=race),
                              self.results.extend, VerifierMetrics(),
                              threaded=False)

    def turn(self, n: int = 1) -> list[Result]:
        start = len(self.results)
        for _ in range(n):
            self.core._iterate(0.0)
        return self.results[start:]

    def of(self, kind: type, rid: str | None = None) -> list[Result]:
        return [r for r in self.results if isinstance(r, kind) and (rid is None or r.request_id == rid)]

    def tokens(self, rid: str) -> list[int]:
        return [t for r in self.of(Rounded, rid) for t in r.tokens]  # type: ignore[attr-defined]


def prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 250 for i in range(n)]


def test_target_only_sessions_decode_exactly_the_reference(target: LoadedModel) -> None:
    h = Harness(target)
    prompts = [prompt(i, 5 + 3 * i) for i in range(4)]
    for i, p in enumerate(prompts):
        h.core.submit(AddRequest(f"r{i}", p, GREEDY, speculative=False))
    h.turn(40)
    for i, p in enumerate(prompts):
        assert h.tokens(f"r{i}") == greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
        assert h.of(Rounded, f"r{i}")[-1].finished  # type: ignore[attr-defined]
    assert h.runner.kv.reserved_tokens == 0 and not h.core.table.requests  # everything freed


def test_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(target: LoadedModel) -> None:
    h = Harness(target, prefill_chunk=16)
    short, long = prompt(1, 6), prompt(2, 120)
    h.core.submit(AddRequest("short", short, GREEDY, speculative=False))
    h.turn(2)  # the short session is decoding
    h.core.submit(AddRequest("long", long, GREEDY, speculative=False))
    chunks = []
    for _ in range(10):
        before = len(h.tokens("short"))
        h.turn()
        chunks.append(h.core.table.requests["long"].cached if "long" in h.core.table.requests else len(long))
        if not h.of(Rounded, "short") or h.of(Rounded, "short")[-1].finished:  # type: ignore[attr-defined]
            break
        assert len(h.tokens("short")) > before  # every step also advanced the short session
    assert chunks[0] == 16 and chunks[1] == 32  # at most one chunk per step beside running rounds
    h.turn(40)
    assert h.tokens("long") == greedy_reference(target.model, long, GREEDY.max_tokens, target.eos_ids)


def test_a_step_with_nothing_to_verify_prefills_up_to_the_token_budget(target: LoadedModel) -> None:
    h = Harness(target, prefill_chunk=16, max_batch_tokens=100)
    h.core.submit(AddRequest("long", prompt(3, 150), GREEDY, speculative=True))
    h.turn()
    assert h.core.table.requests["long"].cached == 100


def test_budgets_are_counted_for_speculating_rounds_only_and_changes_only_when_they_change(
        target: LoadedModel) -> None:
    """Fixed k = 3: each speculating round hands 3 on, the same as before (no change); the
    target-only session's rounds hand nothing and are not counted."""
    h = Harness(target)
    p = prompt(5, 8)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True))
    h.core.submit(AddRequest("t", prompt(6, 8), GREEDY, speculative=False))
    h.turn()
    while h.core.table.requests.get("s") is not None:
        req = h.core.table.requests["s"]
        if req.status is Status.WAITING_DRAFT:
            done = len(h.tokens("s"))
            h.core.submit(AddDraft("s", req.round.number, ref[done: done + 3], None, 0.0))
        h.turn()
    h.turn(20)
    handed = len(h.of(Rounded, "s")) - 1  # every round but the last, which finished
    sample = h.core.metrics.registry.get_sample_value
    assert len(h.of(Rounded, "t")) > handed > 0
    assert sample("specfleet_verifier_draft_budget_tokens_count") == handed
    assert sample("specfleet_verifier_draft_budget_tokens_sum") == 3 * handed
    assert sample("specfleet_verifier_draft_budget_changes_total") == 0


def test_speculative_round_accepts_the_target_own_tokens(target: LoadedModel) -> None:
    h = Harness(target)
    p = prompt(4, 9)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True))
    h.turn()
    admitted = h.of(Admitted, "s")[0]
    assert admitted.draft_budget == 3 and h.core.table.requests["s"].status is Status.WAITING_DRAFT  # type: ignore[attr-defined]
    h.core.submit(AddDraft("s", 0, [ref[0], ref[1], (ref[2] + 1) % 300], None, 0.0))
    h.turn()
    first = h.of(Rounded, "s")[0]
    assert (first.accepted, first.tokens) == (2, ref[:3])  # type: ignore[attr-defined]
    assert h.core.table.requests["s"].slot.length == len(p) + 2  # type: ignore[union-attr]  # rejected draft rolled back


def test_the_sled_like_baseline_recomputes_the_whole_context_every_round_with_the_same_tokens(
        target: LoadedModel) -> None:
    h = Harness(target, recompute_context=True)
    p = prompt(4, 9)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True))
    h.turn()
    waits = 0
    while "s" in h.core.table.requests and waits < 20:
        req = h.core.table.requests["s"]
        if req.status is Status.WAITING_DRAFT:
            waits += 1
            assert req.cached == 0 or req.round.number == 0  # nothing kept from the last round
            done = len(h.tokens("s"))
            h.core.submit(AddDraft("s", req.round.number, ref[done : done + 2], None, 0.0))
        h.turn()
    assert h.tokens("s") == ref  # recomputing changes the work, never the tokens
    assert [r.accepted for r in h.of(Rounded, "s")][:3] == [2, 2, 2]  # type: ignore[attr-defined]


def test_out_of_turn_drafts_are_refused_and_change_nothing(target: LoadedModel) -> None:
    h = Harness(target)
    h.core.submit(AddRequest("s", prompt(5, 6), GREEDY, speculative=True))
    h.turn()
    h.core.submit(AddDraft("s", 3, [5], None, 0.0))
    h.core.submit(AddDraft("ghost", 0, [5], None, 0.0))
    h.turn()
    assert [r.request_id for r in h.of(OutOfTurn)] == ["s", "ghost"]
    assert h.core.table.requests["s"].status is Status.WAITING_DRAFT and not h.of(Rounded)


def test_kv_admission_holds_requests_until_memory_frees_then_refuses_beyond_the_queue(target: LoadedModel) -> None:
    h = Harness(target, kv_tokens=40, max_waiting=1)  # each request below reserves 6 + 12 + 8 = 26 rows
    for rid in ("a", "b", "c"):
        h.core.submit(AddRequest(rid, prompt(6, 6), GREEDY, speculative=False))
    h.turn()
    assert [r.request_id for r in h.of(Admitted)] == ["a"]
    refused = h.of(RequestRefused, "c")
    assert refused and refused[0].code == "busy"  # type: ignore[attr-defined]
    assert h.core.table.stats().waiting == 1
    h.turn(30)
    assert [r.request_id for r in h.of(Admitted)] == ["a", "b"]  # b got a's memory once a finished
    assert h.of(Rounded, "b")[-1].finished  # type: ignore[attr-defined]


def test_a_request_larger_than_the_whole_cache_is_refused_at_once(target: LoadedModel) -> None:
    h = Harness(target, kv_tokens=20)
    h.core.submit(AddRequest("huge", prompt(7, 6), SamplingParams(temperature=0.0, max_tokens=100), False))
    h.turn()
    refused = h.of(RequestRefused, "huge")[0]
    assert refused.code == "invalid" and "--kv-cache-gb" in refused.message  # type: ignore[attr-defined]


def test_finish_frees_the_session_and_its_memory_silently(target: LoadedModel) -> None:
    h = Harness(target)
    h.core.submit(AddRequest("s", prompt(8, 6), GREEDY, speculative=True))
    h.turn()
    assert h.runner.kv.reserved_tokens > 0
    h.core.submit(Finish("s"))
    assert not h.turn()
    assert h.runner.kv.reserved_tokens == 0 and "s" not in h.core.table.requests


def test_detach_and_silent_drafters_continue_target_only(target: LoadedModel) -> None:
    h = Harness(target, draft_timeout_s=0.0)
    p = prompt(9, 7)
    h.core.submit(AddRequest("silent", p, GREEDY, speculative=True))
    h.core.submit(AddRequest("left", p, GREEDY, speculative=True))
    h.core.submit(Detach("left"))
    h.turn(30)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    assert h.tokens("silent") == ref and h.tokens("left") == ref
    assert [r.request_id for r in h.of(Detached)] == ["silent"]  # a Detach command needs no echo


class EveryOther:
    """Budget 2, then 0, then 2, ...: rounds with and without drafts, alternating."""

    name = "every-other"

    def __init__(self) -> None:
        self.next: dict[str, int] = {}

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        return 2

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        return {r.session_id: 0 if r.drafted else 2 for r in rounds}


def test_rounds_with_budget_zero_run_target_only_without_waiting(target: LoadedModel) -> None:
    h = Harness(target, allocator=EveryOther())
    p = prompt(6, 7)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True))
    h.turn()
    budget, done = 2, []
    while h.core.table.requests.get("s") is not None:
        req = h.core.table.requests["s"]
        if budget:  # the drafter's move: the target's own next tokens
            assert req.status is Status.WAITING_DRAFT
            h.core.submit(AddDraft("s", req.round.number, ref[len(done): len(done) + budget], None, 0.0))
        else:
            assert req.status is Status.READY  # no draft awaited
        h.turn()
        last = h.of(Rounded, "s")[-1]
        done += last.tokens  # type: ignore[attr-defined]
        budget = last.draft_budget  # type: ignore[attr-defined]
    assert done == ref
    assert [r.drafted for r in h.of(Rounded, "s")][:4] == [2, 0, 2, 0]  # type: ignore[attr-defined]
    handed = [r.draft_budget for r in h.of(Rounded, "s")][:-1]  # type: ignore[attr-defined]  # the last one finished
    sample = h.core.metrics.registry.get_sample_value
    assert sample("specfleet_verifier_draft_budget_tokens_count") == len(handed)
    assert sample("specfleet_verifier_draft_budget_tokens_bucket", {"le": "0.0"}) == handed.count(0)
    assert sample("specfleet_verifier_draft_budget_changes_total") == len(handed)  # 2, 0, 2, ...: each a change


def test_a_drafter_pause_runs_that_many_rounds_target_only_then_drafts_again(target: LoadedModel) -> None:
    h = Harness(target)  # Fixed-S: budget 3 every round
    p = prompt(7, 6)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True))
    h.turn()
    req = h.core.table.requests["s"]
    # nothing drafted; do not wait
    h.core.submit(AddDraft("s", req.round.number, [], None, 0.0, asks=DraftAsks(pause_rounds=3)))
    h.turn()
    budgets = [h.of(Rounded, "s")[-1].draft_budget]  # type: ignore[attr-defined]
    for _ in range(3):  # three rounds run without waiting for a draft
        assert h.core.table.requests["s"].status is Status.READY
        h.turn()
        budgets.append(h.of(Rounded, "s")[-1].draft_budget)  # type: ignore[attr-defined]
    assert budgets == [0, 0, 0, 3]
    assert h.core.table.requests["s"].status is Status.WAITING_DRAFT  # the budget is back
    assert h.tokens("s") == ref[: len(h.tokens("s"))] and len(h.tokens("s")) == 4


def test_adaspec_trim_verifies_only_the_drafts_worth_their_cost(target: LoadedModel) -> None:
    expensive = StepTimeEstimator(coef=(5e-3, 0.0, 0.0, 1e-3))  # each fed token costs 5x a step's fixed cost
    h = Harness(target, trim=make_trim("adaspec"), estimator=expensive)
    p = prompt(7, 9)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True))
    h.turn()
    h.core.submit(AddDraft("s", 0, ref[:3], None, 0.0, [0.99, 0.01, 0.01]))
    h.turn()
    first = h.of(Rounded, "s")[0]
    assert first.drafted == 1 and first.tokens == ref[:2]  # type: ignore[attr-defined]
    assert h.core.metrics.trimmed._value.get() == 2


def test_adaspec_trim_learns_that_an_underconfident_drafter_is_right(target: LoadedModel) -> None:
    """Raw confidences of 0.3 are not worth verifying at this cost; every draft is accepted, so once
    an untrimmed probe step has taught the calibration, the trim keeps them."""
    cost = StepTimeEstimator(coef=(5e-4, 0.0, 0.0, 1e-3))  # a fed token costs half a step's fixed part
    h = Harness(target, trim=make_trim("adaspec"), estimator=cost)
    params = SamplingParams(temperature=0.0, max_tokens=4 * 4 * PROBE_EVERY + 8, ignore_eos=True)
    p = prompt(9, 9)
    ref = greedy_reference(target.model, p, params.max_tokens, set())
    h.core.submit(AddRequest("s", p, params, speculative=True, drafter="edge-1"))
    h.turn()
    drafted = []
    for _ in range(4 * PROBE_EVERY):
        done, req = len(h.tokens("s")), h.core.table.requests["s"]
        h.core.submit(AddDraft("s", req.round.number, ref[done : done + 3], None, 0.0, [0.3, 0.3, 0.3]))
        h.turn()
        drafted.append(h.of(Rounded, "s")[-1].drafted)  # type: ignore[attr-defined]
    assert drafted[0] == 0  # uncalibrated: trimmed away
    assert drafted[-4:] == [3] * 4  # calibrated: all kept
    assert h.tokens("s") == ref[: len(h.tokens("s"))]
    assert adaspec(h).calibrations["edge-1"].accept(0.3) > 0.3


def test_the_tracker_learns_each_rounds_acceptance(target: LoadedModel) -> None:
    h = Harness(target)
    p = prompt(8, 9)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True, drafter="edge-1"))
    h.turn()
    h.core.submit(AddDraft("s", 0, [ref[0], (ref[1] + 1) % 300, ref[2]], None, 0.0))
    h.turn()
    est = h.core.budgets.tracker.sessions["s"]
    t = h.core.budgets.tracker
    # 1 of 3 drafts matches the argmax at its position (the third may too, given the wrong second)
    assert est.drafter == "edge-1" and est.rounds == 1 and est.accepted == 1
    matched = [pytest.approx((1 - t.eta) * t.alpha0 + t.eta * k / 3) for k in (1, 2)]
    assert est.alpha in matched and est.goodput == pytest.approx((1 - t.beta) * t.goodput0 + t.beta * 2)


class Recording(FixedAllocator):
    """Fixed-S at 3, keeping every round it is shown."""

    def __init__(self) -> None:
        super().__init__(3)
        self.seen: list[RoundStats] = []

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        self.seen.extend(rounds)
        return super().assign(rounds, tracker)


def test_the_drafters_timing_of_a_draft_reaches_the_allocation(target: LoadedModel) -> None:
    """``Draft.drafting_s`` and ``Draft.ahead`` (via AddDraft) are in the round SmartSpec prices, with
    the core's measure of its verification (``RoundStats.verify_s``)."""
    alloc = Recording()
    h = Harness(target, allocator=alloc)
    p = prompt(8, 9)
    ref = greedy_reference(target.model, p, GREEDY.max_tokens, target.eos_ids)
    h.core.submit(AddRequest("s", p, GREEDY, speculative=True, drafter="edge-1"))
    h.turn()
    h.core.submit(AddDraft("s", 0, ref[:3], None, 0.0, drafting_s=0.021))
    h.turn()
    h.core.submit(AddDraft("s", 1, ref[4:7], None, 0.0, ahead=True))
    h.turn()
    assert [(r.drafted, r.drafting_s, r.ahead) for r in alloc.seen] == [(3, 0.021, False), (3, 0.0, True)]
    # and the core's own time from each draft's arrival to its verdict (SmartSpec's ``rest`` leaves it out)
    assert all(r.verify_s is not None and 0.0 < r.verify_s < 60.0 for r in alloc.seen)


def test_the_gap_between_forwards_is_measured_while_sessions_run_not_across_idleness(target: LoadedModel) -> None:
    """The trim's gap (ConfidenceTrim.gap_s): from one forward's end to the next one's start, while
    sessions run. A pause with no session at all is idleness between requests: it must not count."""
    h = Harness(target, trim=make_trim("adaspec"))
    h.core.submit(AddRequest("a", prompt(1, 5), GREEDY, speculative=False))
    h.turn(3)
    assert 0.0 < adaspec(h).gap_s < IDLE_S / 10
    h.turn(40)
    assert not h.core.table.requests  # finished and freed
    before = adaspec(h).gap_s
    time.sleep(IDLE_S)  # shorter than MAX_GAP_S: only "no session left" tells it from a gap
    h.core.submit(AddRequest("b", prompt(2, 5), GREEDY, speculative=False))
    h.turn(2)
    assert adaspec(h).gap_s < before + GAP_ALPHA * IDLE_S / 10


def test_the_verifiers_busy_time_between_forwards_is_measured_by_sessions_without_idle_waits(
        target: LoadedModel) -> None:
    """SmartSpec's overhead line (estimator.overhead): the CPU the verifier spends from one
    forward's end to the next one's start, against the sessions of the step that just ended. A
    wait with sessions live (for a draft, say) is in the trim's gap but costs no CPU."""
    h = Harness(target, trim=make_trim("adaspec"))
    for i in range(3):
        h.core.submit(AddRequest(f"r{i}", prompt(i, 5), GREEDY, speculative=False))
    h.turn(4)
    points = list(h.core.estimator.overhead.points)
    assert len(points) == 3 and all(x == 3 and 0.0 < y < IDLE_S / 10 for x, y in points)
    time.sleep(IDLE_S)  # the sessions still run: a wait inside their period
    h.turn(1)
    x, busy = h.core.estimator.overhead.points[-1]
    assert x == 3 and 0.0 < busy < IDLE_S / 10
    assert adaspec(h).gap_s > GAP_ALPHA * IDLE_S * 0.9  # the wall-clock gap did see it


def test_a_request_s_slo_clock_starts_when_its_coordinator_took_it(target: LoadedModel) -> None:
    """OpenSession.waited_s (v8): the time a request spent in the queue and at the edge counts
    against its SLO class, so a request that waited 30 s misses a 1 token/s class that the same
    request without the wait meets with ease."""
    h = Harness(target)
    before = time.perf_counter()
    h.core.submit(AddRequest("fresh", prompt(9, 6), GREEDY, speculative=False, slo_tokens_per_s=1.0))
    h.core.submit(AddRequest("waited", prompt(9, 6), GREEDY, speculative=False, slo_tokens_per_s=1.0,
                             carried=Carried(waited_s=30.0)))
    h.turn(1)
    assert before - 30.0 - 1.0 < h.core.table.requests["waited"].arrived_at < time.perf_counter() - 30.0
    assert h.core.table.requests["fresh"].arrived_at >= before
    h.turn(40)
    sample = h.core.metrics.registry.get_sample_value
    key = "specfleet_verifier_slo_requests_total"
    assert sample(key, {"slo_class": "1", "outcome": "attained"}) == 1.0
    assert sample(key, {"slo_class": "1", "outcome": "violated"}) == 1.0


def adaspec(h: Harness) -> ConfidenceTrim:
    """The harness's trim policy, which these tests made AdaSpec's."""
    assert isinstance(h.core.scheduler.trim, ConfidenceTrim)
    return h.core.scheduler.trim
