"""The simulator's pipelined drafting (lookaheads, conditional drafts) and its links' jitter."""

from __future__ import annotations

import random

import pytest

from bench.sim import CostSpec, DrafterSpec, SimResult, SimSpec, VerifierSpec, simulate
from bench.sim.engine import Simulation
from bench.sim.state import Lookahead, Session
from services.drafter.control.base import StepDecision
from tests.unit.draft_proposer_support import StopAt

H100 = CostSpec("h100")

# --- lookaheads and conditional drafts ---------------------------------------------------------

def test_a_lookahead_that_came_true_waits_for_its_verdict_as_a_drafted_round_does() -> None:
    """α = 1, one session: every lookahead comes true, and the wait from a draft leaving to its
    verdict is the same with pipelining as without (only the drafting after it is saved)."""
    off, on = pipelined(1.0, 0), pipelined(1.0, 1)
    assert on.lookaheads_used > 0
    assert on.verdict_wait_s == pytest.approx(off.verdict_wait_s)


def pipelined(alpha: float, pipeline_sessions: int, concurrency: int = 1, rtt_s: float = 0.01,
              conditional: bool = False, lookahead_token_s: float = 0.0, fill: bool = False) -> SimResult:
    d = DrafterSpec("d0", alpha=alpha, token_s=2e-3, round_s=5e-4, rtt_s=rtt_s, max_tokens=50, prompt_len=16,
                    concurrency=concurrency, requests=4, pipeline_sessions=pipeline_sessions, conditional=conditional,
                    lookahead_token_s=lookahead_token_s)
    return simulate(SimSpec(drafters=(d,), cost=H100, rounds=None, duration_s=600.0, verifier=VerifierSpec(fill=fill)))


def test_conditional_drafts_save_a_round_trip_per_round_when_every_draft_is_accepted() -> None:
    """α = 1, one session over 40 ms: each lookahead is done long before its verdict and goes to
    the verifier, which verifies it as soon as the round it assumes ends. Every round but a
    request's first is one of them; a round then takes less than the round trip, which every round
    needs without them (the drafter hears the verdict of one round while the next is verified, and
    looks ahead past it at once)."""
    off, on = pipelined(1.0, 1, rtt_s=0.04), pipelined(1.0, 1, rtt_s=0.04, conditional=True)
    assert on.committed == off.committed == 4 * 50 and on.requests_done == 4
    presented = on.rounds - on.requests_done
    assert on.conditional_taken == on.lookaheads_used == presented > 0 and off.conditional_sent == 0
    assert on.conditional_sent >= on.conditional_taken
    assert off.latency_s is not None and on.latency_s is not None
    assert on.latency_s * on.requests_done / on.rounds < 0.04 < off.latency_s * off.requests_done / off.rounds


def test_a_conditional_draft_is_cut_where_the_controller_would_stop_it_and_shown_to_it_when_held() -> None:
    """As the real drafter does: the cut is the controller's pure screen (``keeps``: the threshold
    rule stops after the unsure second token); the round that finds the draft held shows the
    controller the drafts the verifier verifies."""
    sim = Simulation(SimSpec(drafters=(DrafterSpec("d0", conditional=True),), cost=H100, rounds=1))
    controller = StopAt(1, StepDecision.STOP)
    s = Session("s0", sim.edges[0], 16, 30, None, 0.0, controller)
    drawn = [(0.9, True), (0.3, True), (0.9, True), (0.9, True)]
    sim._propose = lambda s, k, screen=True, rows=1: (drawn[:k], k)  # type: ignore[method-assign]
    ahead = Lookahead(True, 4, 0)
    sim._presend(s, ahead)
    assert ahead.sent and ahead.drafts == drawn[:2] and controller.seen == []
    sim._presented(s, ahead, 4)
    assert [step.position for step in controller.seen] == [0, 1]


def test_conditional_drafts_that_never_come_true_are_dropped() -> None:
    off, on = pipelined(0.0, 1, rtt_s=0.04), pipelined(0.0, 1, rtt_s=0.04, conditional=True)
    assert on.committed == off.committed and on.accepted == off.accepted == 0
    assert on.conditional_sent > 0 and on.conditional_taken == on.lookaheads_used == 0


def test_a_conditional_draft_after_its_verdict_left_is_taken_on_arrival() -> None:
    """A lookahead of 5 × 7 ms is done 35 ms after its round's draft left: after the verifier sent
    the verdict (about 20 ms), before the drafter heard it (about 40 ms). The verifier, waiting for
    the next round's draft, takes it when it comes, 15 ms before a fresh one would have left."""
    off, on = (pipelined(1.0, 1, rtt_s=0.04, conditional=c, lookahead_token_s=7e-3) for c in (False, True))
    assert on.committed == off.committed and on.conditional_taken == on.rounds - on.requests_done
    assert off.latency_s is not None and on.latency_s is not None and on.latency_s < off.latency_s


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_conditional_drafts_and_filling_commit_every_token_once(alpha: float) -> None:
    r = pipelined(alpha, 1, rtt_s=0.04, conditional=True, fill=True)
    assert r.requests_done == 4 and r.committed == 4 * 50
    # the fill policy learns from plain drafts only: each simulated draft travels exactly 40 ms, so
    # their waits barely spread
    [wait], [off] = r.fill_wait_s, r.fill_wait_deviation_s
    if alpha < 1.0:  # at α = 1 a round past the first always takes a conditional draft
        assert wait is not None and wait >= 0.04 and off is not None and off < 0.01
    assert r.filled > 0 or alpha == 1.0  # at α = 1 every round past the first has its draft at once


def test_pipelined_drafting_hides_the_draft_time_when_every_draft_is_accepted() -> None:
    off, on = pipelined(1.0, 0), pipelined(1.0, 1)
    assert on.requests_done == off.requests_done == 4 and on.committed == off.committed
    assert off.lookaheads == 0 and on.lookaheads_used == on.rounds - on.requests_done  # all but each first round
    assert off.latency_s is not None and on.latency_s is not None
    # every round but a request's first finds its draft ready: round_s + k·token_s less per round
    saved_per_round = (off.latency_s - on.latency_s) * on.requests_done / (on.rounds - on.requests_done)
    assert saved_per_round == pytest.approx(5e-4 + 4 * 2e-3, rel=0.01)


@pytest.mark.parametrize("rtt_s", [0.01, 0.0])  # without RTT the verdict comes mid-lookahead
def test_lookaheads_that_never_come_true_only_cost_time(rtt_s: float) -> None:
    off, on = pipelined(0.0, 0, rtt_s=rtt_s), pipelined(0.0, 1, rtt_s=rtt_s)
    assert on.committed == off.committed and on.accepted == off.accepted == 0
    assert on.lookaheads > 0 and on.lookaheads_used == 0
    assert on.latency_s is not None and off.latency_s is not None and on.latency_s >= off.latency_s
    # drafted a token at a time and dropped by the verdict: a round waits for one token at most
    lost_per_round = (on.latency_s - off.latency_s) * on.requests_done / on.rounds
    assert lost_per_round <= 2e-3


def test_no_lookaheads_beyond_pipeline_sessions() -> None:
    """4 identical requests at once, all live until they end together: 1 is below that."""
    on, off = pipelined(1.0, 1, concurrency=4), pipelined(1.0, 0, concurrency=4)
    assert (on.latency_s, on.committed, on.steps) == (off.latency_s, off.committed, off.steps)
    assert on.latency_s is not None and (pipelined(1.0, 4, concurrency=4).latency_s or 0.0) < on.latency_s


# --- link jitter -------------------------------------------------------------------------------


def test_a_jittered_link_delays_each_message_within_its_range_and_never_reorders_a_direction() -> None:
    rng = random.Random(1)
    sim = Simulation(SimSpec(drafters=(DrafterSpec("d", rtt_s=0.02, jitter_s=0.005),), cost=H100))
    edge = sim.edges[0]
    for up in (True, False):
        arrivals = [edge.carry(i * 1e-3, up, rng) for i in range(200)]
        assert arrivals == sorted(arrivals)  # one connection each way: no overtaking
        delays = [at - i * 1e-3 for i, at in enumerate(arrivals)]
        assert min(delays) >= 0.01 and max(delays) <= 0.015 + 1e-3  # half the RTT + [0, 5 ms] (+ the one before)
    plain = Simulation(SimSpec(drafters=(DrafterSpec("d", rtt_s=0.02),), cost=H100)).edges[0]
    assert [plain.carry(t, True, rng) for t in (0.0, 0.5)] == [0.01, 0.51]


@pytest.mark.parametrize("fill", [False, True])
def test_a_jittered_fleet_commits_every_token_once(fill: bool) -> None:
    d = DrafterSpec("d", alpha=0.7, rtt_s=0.04, jitter_s=0.01, max_tokens=40, prompt_len=16, concurrency=4,
                    requests=12, pipeline_sessions=4)
    r = simulate(SimSpec(drafters=(d,), cost=H100, rounds=None, duration_s=3600.0, verifier=VerifierSpec(fill=fill)))
    assert r.requests_done == 12 and r.committed == 12 * 40
    assert r.draft_batch_sessions[0] is not None and 1.0 <= r.draft_batch_sessions[0] <= 4.0
