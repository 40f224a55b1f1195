"""The fast-rounds targets, computed from one run's measurements (``bench.serving``).

Each check says how it is computed, so the numbers in ``bench/results/serving.md`` can be
re-derived from ``serving.json`` by hand:

* target-only serving at 1 concurrent request vs the raw decode rate of the same model on the
  same CPU (a plain transformers greedy loop), and vs the same loop on specfleet's runner;
* speculation at 1 concurrent request vs the zero-overhead rate (1 + k a) / (k t_draft +
  t_verify(k+1)), with the run's acceptance a and the pure model costs of the same run;
* at 16 concurrent requests, the verifier's CPU per engine step over its forward time.
"""

from __future__ import annotations

from typing import Any

from bench.client import percentiles
from bench.fleets import Run
from bench.scrape import Snapshot

V = "specfleet_verifier"


def run_row(run: Run, drafter: Snapshot | None) -> dict[str, Any]:
    v = run.metrics["verifier"]
    steps = v.count(f"{V}_step_seconds", phase="forward")
    forward = v.mean(f"{V}_step_seconds", phase="forward")
    cpu = v.value("process_cpu_seconds_total") / steps if steps else 0.0
    fcpu = v.value(f"{V}_forward_cpu_seconds_total") / steps if steps else 0.0
    return {
        "scenario": run.scenario, "concurrency": run.concurrency, "tokens_per_s": run.tokens_per_s,
        "tokens_per_s_runs": run.rates, "acceptance": run.acceptance, "steps": steps,
        "ttft_ms": percentiles([o.ttft_s * 1e3 for o in run.outcomes]),
        "tpot_ms": percentiles([o.tpot_s * 1e3 for o in run.outcomes if o.tokens > 1]),
        "mean_batch_sessions": v.mean(f"{V}_batch_sessions"), "mean_batch_tokens": v.mean(f"{V}_batch_tokens"),
        "forward_ms": forward * 1e3, "forward_cpu_ms": fcpu * 1e3, "cpu_per_step_ms": cpu * 1e3,
        "cpu_per_step_over_forward": cpu / fcpu if fcpu else 0.0,
        "step_period_over_forward": v.mean(f"{V}_step_period_seconds") / forward if forward else 0.0,
        "draft_ms_per_round": drafter.mean("specfleet_drafter_round_phase_seconds", phase="draft") * 1e3
        if drafter is not None else 0.0,
        "drafted_tok_s": run.tokens_per_s * sum(o.drafted for o in run.outcomes) / max(1, sum(
            o.tokens for o in run.outcomes)),
        "draft_idle_fraction": _idle(drafter),
        "lookahead_used": drafter.value("specfleet_drafter_lookaheads_total", outcome="used")
        if drafter is not None else 0.0,
        "alternatives_used": drafter.value("specfleet_drafter_alternative_lookaheads_used_total")
        if drafter is not None else 0.0,
    }


def _idle(drafter: Snapshot | None) -> float:
    """The draft model's idle fraction (StarSD's T_idle share) over the run."""
    if drafter is None:
        return 0.0
    idle = drafter.value("specfleet_drafter_model_idle_seconds_total")
    busy = drafter.value("specfleet_drafter_model_busy_seconds_total")
    return idle / (idle + busy) if idle + busy else 0.0


def _row(rows: list[dict[str, Any]], spec: bool, conc: int) -> dict[str, Any] | None:
    return next((r for r in rows if (r["scenario"] != "target-only") == spec and r["concurrency"] == conc), None)


def targets(rows: list[dict[str, Any]], costs: dict[str, Any], k: int) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    tgt, dft = costs["target"], costs["draft"]
    only1, spec1 = _row(rows, False, 1), _row(rows, True, 1)
    if only1 is not None:
        checks.append(_check("target-only @1 / raw decode (transformers loop)", only1["tokens_per_s"]
                             / tgt["hf_decode_tok_s"], 0.90, "target-only tokens/s over hf_decode_tok_s"))
        checks.append(_check("target-only @1 / raw decode (runner loop)", only1["tokens_per_s"]
                             / tgt["runner_decode_tok_s"], 0.90, "target-only tokens/s over runner_decode_tok_s"))
        if "floor" in tgt:
            fl = tgt["floor"]
            checks.append(_check("target-only @1 / the floor", only1["tokens_per_s"] / fl["floor_tok_s"], 0.85,
                                 f"target-only tokens/s over the floor, {fl['floor_tok_s']:.1f} tok/s: "
                                 f"{fl['weight_bytes'] / 1e6:.0f} MB of {fl['dtype']} weights at a GEMV's "
                                 f"{fl['gemv_gb_s']:.1f} GB/s on the server core ({fl['floor_ms']:.1f} ms a step)"))
    if spec1 is not None:
        a = spec1["acceptance"]
        t_draft = dft["forward_ms"]["1x128x1"]
        t_verify = tgt["forward_ms"][f"1x128x{k + 1}"]
        bound = (1 + k * a) / (k * t_draft + t_verify) * 1e3
        checks.append(_check("speculation @1 / zero-overhead rate", spec1["tokens_per_s"] / bound, 0.85,
                             f"(1 + k a) / (k t_draft + t_verify(k+1)) with k={k}, a={a:.3f}, t_draft={t_draft:.3f} ms "
                             f"(draft 1x128x1), t_verify={t_verify:.3f} ms (target 1x128x{k + 1}) = {bound:.1f} tok/s"))
    for spec in (False, True):
        row = _row(rows, spec, 16)
        if row is not None:
            checks.append(_check(f"{'speculation' if spec else 'target-only'} @16: verifier CPU per step / forward",
                                 row["cpu_per_step_over_forward"], 1.15,
                                 f"verifier process CPU per engine step over the forward's own CPU per step "
                                 f"({row['cpu_per_step_ms']:.2f} / {row['forward_cpu_ms']:.2f} ms; "
                                 f"{row['mean_batch_sessions']:.1f} sessions per step)", below=True))
    return checks


def _check(name: str, value: float, goal: float, how: str, below: bool = False) -> dict[str, Any]:
    return {"name": name, "value": value, "goal": f"{'<=' if below else '>='} {goal}",
            "met": value <= goal if below else value >= goal, "how": how}
