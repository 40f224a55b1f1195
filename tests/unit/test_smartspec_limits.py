"""SmartSpec prices the verifier's batch limits: more live sessions than one forward takes are
verified in several forwards, each paying the forward's fixed cost and the busy time between
forwards, which shorter drafts amortise worse."""

from __future__ import annotations

import math

import pytest

from bench.sim import CostSpec, DrafterSpec, Policies, SimSpec
from bench.sim.engine import Simulation
from services.verifier.allocation import AllocationSettings, SmartSpecAllocator, make_allocator
from services.verifier.allocation.draft_wait import DraftWaitModel
from services.verifier.allocation.smartspec import best_length, goodputs, verify_all
from services.verifier.batching.base import BatchLimits
from services.verifier.batching.estimator import RecentLine, SegmentShape, StepTimeEstimator
from services.verifier.config import VerifierConfig
from services.verifier.main import make_allocator_for
from shared.config import from_flags
from tests.unit.test_allocation import Linear


def busy_line(e0: float, e1: float) -> RecentLine:
    line = RecentLine(refit_every=1)
    for n in (1, 16, 32):
        line.observe(n, e0 + e1 * n)
    return line


@pytest.mark.parametrize(("sessions", "per_step", "forwards", "sizes"), [
    (1, 32, 1, [1]),
    (32, 32, 1, [32]),  # exactly one full forward
    (33, 32, 2, [32, 1]),  # one session over: a second forward
    (96, 32, 3, [32, 32, 32]),
    (50, 16, 4, [16, 16, 16, 2]),
])
def test_a_round_of_every_session_takes_as_many_forwards_as_the_limit_needs(
        sessions: int, per_step: int, forwards: int, sizes: list[int]) -> None:
    model, overhead, one = Linear(4e-3, 0.1e-3), busy_line(1e-3, 0.05e-3), SegmentShape(new=4, cached=100)
    assert math.ceil(sessions / per_step) == forwards == len(sizes)
    want = forwards * 4e-3 + sessions * 4 * 0.1e-3 + sum(1e-3 + 0.05e-3 * m for m in sizes)
    assert verify_all(model, one, sessions, per_step, overhead) == pytest.approx(want)


@pytest.mark.parametrize("sessions", [1, 8, 32])
def test_within_the_limits_the_price_is_the_papers_one_batch(sessions: int) -> None:
    model, overhead, limits = Linear(4e-3, 0.2e-3), busy_line(1e-3, 0.05e-3), BatchLimits(32, 2048)
    assert goodputs(0.7, sessions, 100, 8, model, DraftWaitModel(), overhead, limits) == pytest.approx(
        goodputs(0.7, sessions, 100, 8, model, DraftWaitModel(), overhead))


def test_past_the_session_limit_the_extra_forwards_favour_speculation() -> None:
    """96 sessions on a forward of 8 ms + 0.2 ms per fed token, α = 0.6: priced as one forward,
    plain decoding's 27 ms round beats every draft length; in the verifier's three forwards of 32,
    each paying the 8 ms, one draft token per session pays (k = 0: 96 tokens in 43 ms, k = 1:
    153.6 in 62 ms)."""
    model = Linear(8e-3, 0.2e-3)
    k_one_batch, _ = best_length(0.6, 96, 100, 8, model, DraftWaitModel())
    k, goodput = best_length(0.6, 96, 100, 8, model, DraftWaitModel(), limits=BatchLimits(32, 2048))
    assert (k_one_batch, k) == (0, 1)
    assert goodput == pytest.approx(96 * 1.6 / (3 * 8e-3 + 96 * 2 * 0.2e-3))


def test_the_token_limit_splits_long_drafts_sooner() -> None:
    """64 tokens a forward: 16 sessions of 1 + 3 tokens fit, so 32 take two forwards at k = 3
    but one at k = 0 (32 tokens)."""
    model, limits = Linear(8e-3, 0.2e-3), BatchLimits(64, 64)
    g = goodputs(0.5, 32, 100, 3, model, DraftWaitModel(), limits=limits)
    assert g[0] == pytest.approx(32 / (8e-3 + 32 * 0.2e-3))
    assert g[3] == pytest.approx(32 * (1 - 0.5 ** 4) / 0.5 / (2 * 8e-3 + 32 * 4 * 0.2e-3))


def test_a_draft_longer_than_the_token_limit_takes_a_forward_of_its_own() -> None:
    """4 tokens a forward and 1 + 4 to feed each: the batcher admits one session over the budget
    (it always takes the first), so 8 sessions take 8 forwards."""
    model = Linear(8e-3, 0.2e-3)
    g = goodputs(0.5, 8, 100, 4, model, DraftWaitModel(), limits=BatchLimits(32, 4))
    assert g[4] == pytest.approx(8 * (1 - 0.5 ** 5) / 0.5 / (8 * 8e-3 + 8 * 5 * 0.2e-3))
    assert g[1] == pytest.approx(8 * 1.5 / (4 * 8e-3 + 8 * 2 * 0.2e-3))  # 1 + 1 tokens: 2 a forward


def test_the_verifier_and_the_simulator_give_smartspec_their_batch_limits() -> None:
    cfg = from_flags(VerifierConfig, allocation="smartspec", max_batch_sessions=7, max_batch_tokens=99,
                     speculation_guard=False)
    alloc = make_allocator_for(cfg, StepTimeEstimator())
    assert isinstance(alloc, SmartSpecAllocator) and alloc.limits == BatchLimits(7, 99)
    d = DrafterSpec("d0", token_s=1e-3, round_s=2e-3, prefill_token_s=0.0, send_s=5e-4, concurrency=1)
    sim = Simulation(SimSpec(drafters=(d,), policies=Policies(allocation="smartspec"), cost=CostSpec("h100"), rounds=1))
    simulated = sim.verifier.allocator
    assert isinstance(simulated, SmartSpecAllocator)
    assert simulated.limits == BatchLimits(sim.spec.verifier.max_sessions, sim.spec.verifier.max_tokens)


def test_the_allocation_settings_carry_the_verifiers_limits_to_smartspec() -> None:
    limits = BatchLimits(32, 2048)
    alloc = make_allocator("smartspec", AllocationSettings(limits=limits), Linear(8e-3, 0.2e-3))
    assert isinstance(alloc, SmartSpecAllocator) and alloc.limits == limits
    plain = make_allocator("smartspec", AllocationSettings(), Linear(8e-3, 0.2e-3))
    assert isinstance(plain, SmartSpecAllocator) and plain.limits is None
