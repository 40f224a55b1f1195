"""How the benchmarks build their fleets: each scenario's verifier policy (a benchmark's k is
Fixed-S; the default fleets run the verifier's default), the fairness drafter kinds of the real
family, the SLO fleets, and the edge drafters' queue address."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.edge import Edge
from bench.fairness import REAL_FAMILY, parse_drafters, scenario
from bench.fleets import Scenario, allocation_flags, fleet_spec
from bench.slo import scenarios as slo_scenarios
from shared.fleet import FleetSpec, plan


def test_fairness_drafters_parse_and_bad_ones_are_refused() -> None:
    assert parse_drafters("small@0,large@10,ngram") == [("small", 0.0), ("large", 10.0), ("ngram", 0.0)]
    with pytest.raises(ValueError, match="unknown drafter kind"):
        parse_drafters("tiny@0,small@0")
    with pytest.raises(ValueError, match="at least 2"):
        parse_drafters("small@0")


def test_fairness_kinds_map_to_the_real_familys_drafts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF kinds are the target's copies beside it; small and large the distilled drafts of
    models/ (not the GGUF drafts specfleet up defaults to); prompt lookup reads the target."""
    for name in ("draft-small", "draft-large"):
        (tmp_path / "models" / name).mkdir(parents=True)
    monkeypatch.setattr("bench.fairness.DISTILLED", tmp_path / "models")
    monkeypatch.setattr("bench.fairness.smallest", lambda paths: sorted(paths)[-1])  # draft-small
    monkeypatch.setattr("bench.fairness.largest", lambda paths: sorted(paths)[0])  # draft-large
    target = tmp_path / "m" / "target"
    sc = scenario("goodspeed", parse_drafters(REAL_FAMILY + ",large@0,q8_0@0"), [], 12, target)
    copy, distilled = target.parent / "target", tmp_path / "models"
    assert sc.drafts == (f"{copy}.Q4_1.gguf", f"{copy}.Q4_0.gguf", str(distilled / "draft-small"), str(target),
                         str(distilled / "draft-large"), f"{copy}.Q8_0.gguf")
    assert sc.per_drafter_flags[3] == ("--proposer", "ngram") and not any(sc.per_drafter_flags[:3])
    assert sc.drafter_rtts == (0.0, 10.0, 10.0, 40.0, 0.0, 0.0)


def test_edge_drafters_reach_redis_through_the_edge_address() -> None:
    spec = FleetSpec(target=Path("t"), drafts=[Path("d")],
                     redis_url="redis://127.0.0.1:6379/0", edge_queue_addr="10.77.0.1:5555")
    drafter = dict(plan(spec))["drafter-1"]
    assert drafter[drafter.index("--queue-url") + 1] == "redis://10.77.0.1:5555/0"
    coordinator = dict(plan(spec))["coordinator"]
    assert coordinator[coordinator.index("--redis-url") + 1] == "redis://127.0.0.1:6379/0"


def test_slo_fleets_differ_only_in_their_batching_and_take_every_session() -> None:
    fcfs, wisp = slo_scenarios(Path("models/draft-small"), 4, "p.json", "ngram", 128, 60.0)
    assert (fcfs.name, wisp.name) == ("fcfs", "wisp")
    assert fcfs.verifier_flags == ("--batching", "fcfs", "--estimator-file", "p.json")
    assert wisp.verifier_flags == ("--batching", "wisp", "--estimator-file", "p.json", "--wisp-network-ms", "60")
    assert fcfs.drafter_flags == wisp.drafter_flags == ("--proposer", "ngram", "--max-sessions", "128")
    spec, _ = fleet_spec(Path("models/target"), wisp, Edge(server_cpus="", edge_cpus=""))
    flags = spec.drafter_flags
    last = max(i for i, f in enumerate(flags) if f == "--max-sessions")
    assert flags[last + 1] == "128"  # after the harness's own default: the last one wins


@pytest.mark.parametrize(("scenario", "want"), [
    (Scenario("k=4", drafters=1, draft="d", draft_len=4), ("--allocation", "fixed")),  # a benchmark's k is Fixed-S
    (Scenario("own", drafters=1, draft="d", verifier_flags=("--allocation", "smartspec")), ()),
    (Scenario("as specfleet up", drafters=1, draft="d", allocation=""), ()),  # the verifier's default policy
])
def test_a_scenarios_verifier_runs_fixed_k_unless_it_names_a_policy(scenario: Scenario, want: tuple[str, ...]) -> None:
    assert allocation_flags(scenario) == want
    flags = fleet_spec(Path("t"), scenario, Edge("", ""))[0].verifier_flags
    assert flags.count("--allocation") == 1 - (scenario.allocation == "")


def test_the_default_fleets_run_the_verifiers_default_policy() -> None:
    from bench.edge_drafts import scenarios as edge_scenarios
    from bench.real import scenarios as real_scenarios

    fleets = [*edge_scenarios(Path("t")).values(), *real_scenarios(Path("t")).values()]
    assert all(allocation_flags(sc) == () for sc in fleets if sc.drafters and "Fixed-S" not in sc.name)
    baselines = [sc for sc in fleets if "Fixed-S" in sc.name]  # the length policy's baseline, named as such
    assert baselines and all(allocation_flags(sc) == ("--allocation", "fixed") for sc in baselines)


def test_a_runs_busy_shares_say_which_side_bounds_it() -> None:
    from bench.edge_drafts import busy_shares
    from bench.fleets import Run
    from bench.scrape import Snapshot

    def snap(**samples: float) -> Snapshot:
        return Snapshot({(name, tuple(sorted(labels.items()))): v for name, (labels, v) in samples.items()})

    metrics = {"verifier": snap(specfleet_verifier_step_seconds_sum=({"phase": "total"}, 6.0),
                                process_cpu_seconds_total=({}, 7.0)),
               "coordinator": snap(process_cpu_seconds_total=({}, 1.0)),
               "drafter-1": snap(specfleet_drafter_model_busy_seconds_total=({}, 5.0),
                                 process_cpu_seconds_total=({}, 6.0)),
               "drafter-2": snap(specfleet_drafter_model_busy_seconds_total=({}, 2.0),
                                 process_cpu_seconds_total=({}, 2.5))}
    run = Run("fleet", 4, [10.0, 10.0], [], metrics, walls=[4.0, 6.0])
    assert busy_shares(run) == pytest.approx({"verifier": 0.6, "draft_models": 0.7, "edge_services": 0.95})


def test_a_runs_drafting_says_what_the_draft_models_spent_per_committed_token() -> None:
    from bench.edge_drafts import drafting, drafting_table
    from bench.fleets import Run
    from bench.scrape import Snapshot

    def drafter(busy: float, ahead_busy: float, rounds: float, committed: float, drafted: float, accepted: float,
                used: float, missed: float, dropped: float) -> Snapshot:
        p = "specfleet_drafter_"
        plain = {"model_busy_seconds_total": busy, "lookahead_busy_seconds_total": ahead_busy, "rounds_total": rounds,
                 "committed_tokens_total": committed, "drafted_tokens_total": drafted,
                 "accepted_tokens_total": accepted}
        out = Snapshot({(p + k, ()): v for k, v in plain.items()})
        for outcome, v in (("used", used), ("missed", missed), ("dropped", dropped)):
            out[(p + "lookaheads_total", (("outcome", outcome),))] = v
        out[(p + "draft_batch_sessions_sum", (("kind", "round"),))] = rounds * 1.5
        out[(p + "draft_batch_sessions_count", (("kind", "round"),))] = rounds
        return out

    metrics = {"verifier": Snapshot(), "drafter-1": drafter(3.0, 1.0, 100, 600, 500, 450, 60, 20, 10),
               "drafter-2": drafter(1.0, 1.0, 100, 400, 300, 250, 10, 5, 15)}
    found = drafting(Run("fleet", 1, [1.0], [], metrics, walls=[1.0]))
    assert found == pytest.approx({"busy_ms_per_committed": 4.0, "drafted_per_round": 4.0,
                                   "accepted_per_round": 3.5, "lookaheads_per_round": 0.6,
                                   "lookaheads_used": 70 / 120, "lookahead_busy_share": 0.5,
                                   "round_batch_sessions": 1.5})
    rows = [{"scenario": "target-only", "concurrency": 1, "drafting": drafting(Run("t", 1, [1.0], [], {}, [1.0]))},
            {"scenario": "fleet", "concurrency": 1, "drafting": found}]
    table = drafting_table(rows)
    assert [line.split(" | ")[:3] for line in table if line.startswith("| fleet")] == [["| fleet", "1", "4.00"]]
    assert drafting_table(rows[:1]) == []


@pytest.mark.parametrize(("estimate", "reads", "met"), [
    (1.96, 13, True),  # 2026-12-05 20:45: 1.96x shown, 1.85x served
    (1.54, 3, False),  # 18:55: 1.54x from three reads that spanned the idle second before the load
    (0.80, 6, True),  # 15 % low at most
    (2.20, 2, None),  # too few reads to judge: no check
])
def test_the_dashboards_estimate_is_checked_against_the_measured_ratio(estimate: float, reads: int,
                                                                        met: bool | None) -> None:
    from bench.edge_drafts import checks

    fleet = {"scenario": "default fleet (Q4_1 + Q8_0)", "concurrency": 1, "ratio": 1.85 if estimate > 1 else 0.92,
             "speedup_estimate": estimate, "speedup_estimate_reads": reads}
    found = [c for c in checks([fleet], {}, 0.0) if c["name"].startswith("the dashboard's")]
    assert [c["met"] for c in found] == ([] if met is None else [met])


@pytest.mark.parametrize(("levels", "latency"), [((1, 4, 16), True), ((1,), False)])
def test_edge_drafts_plot_adds_the_latency_picture_over_several_loads(tmp_path: Path, levels: tuple[int, ...],
                                                                       latency: bool) -> None:
    from bench.edge_drafts import plot

    rows = [{"scenario": name, "concurrency": c, "ratio": 1.0 + i, "tokens_per_s": 40.0 * c * (1 + i),
             "tpot_ms": {"p50": 20.0 + c, "p99": 25.0 + c}} for i, name in enumerate(("target-only", "fleet"))
            for c in levels]
    plot(rows, tmp_path / "edge-drafts.png", {"temperature": 0.0, "dtype": "bfloat16", "when": "2026-12-07 04:00"})
    assert (tmp_path / "edge-drafts.png").stat().st_size > 0
    assert (tmp_path / "edge-drafts-latency.png").exists() is latency
