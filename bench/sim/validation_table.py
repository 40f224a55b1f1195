"""The Markdown page of ``python -m bench sim-validate`` (``bench.sim.validate``)."""

from __future__ import annotations

from typing import Any


def per_drafter(values: list[float], digits: int) -> str:
    """One value per drafter when they differ, else one."""
    if not values:
        return ""
    return "/".join(f"{v:.{digits}f}" for v in values) if len(set(values)) > 1 else f"{values[0]:.{digits}f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], tolerance: float) -> list[str]:
    """The page of ``python -m bench sim-validate``: its settings, then a row per compared run."""
    done = [r for r in rows if "skipped" not in r]
    ok = sum(1 for r in done if r["within"])
    lines = [f"Command: `{meta['command']}` ({meta['when']}); real runs from {', '.join(meta['sources'])}.", "",
             f"{ok} of {len(done)} rows within {tolerance:.0%} on both goodput and mean latency.", "",
             "Each row: the median rate over the real run's repeats, each simulated with "
             f"{meta.get('seeds', 1)} seed(s) (`--seeds`), and the mean latency over all their requests.", "",
             "RTT ms: each simulated drafter's round trip to the verifier, its configured RTT or, when longer, "
             "its rounds' measured link time (network and event loops).", "",
             f"Draft model: a forward's fixed cost is {meta.get('draft_forward_rows', 0):g} rows' worth "
             "(`--draft-forward-rows`), split from each drafter's measured cost at its round batches' mean "
             "sessions.", "",
             "Verifier: " + ("fills while drafts travel, with the real fill policy (`--fill`)." if meta.get("fill")
                             else "simulated without filling; the real runs' verifiers filled (`--fill` "
                                  "simulates that)."), "",
             "Drafters: " + ("batches and hand-offs spread as the real rounds' draft and send phases did "
                             "(`--spread`)" if meta.get("spread") else "batches and hand-offs take their mean times")
             + (f"; sharing {meta['edge_cores']:g} edge core(s) (`--edge-cores`)." if meta.get("edge_cores")
                else "; each on a core of its own."), "",
             "| source | scenario | point | real tok/s | sim tok/s | error | real latency s | sim latency s | error | "
             "α | RTT ms | step scale | within |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['source']} | {r['scenario']} | {r['point']} | {r['real_tok_s']:.1f} | | | "
                         f"{r['real_latency_s']:.2f} | | | | | | skipped: {r['skipped']} |")
            continue
        lines.append(f"| {r['source']} | {r['scenario']} | {r['point']} | {r['real_tok_s']:.1f} | "
                     f"{r['sim_tok_s']:.1f} | {r['tok_s_error']:+.0%} | {r['real_latency_s']:.2f} | "
                     f"{r['sim_latency_s']:.2f} | {r['latency_error']:+.0%} | "
                     f"{per_drafter(r.get('alphas') or [r['alpha']], 2)} | {per_drafter(r.get('rtts_ms', []), 1)} | "
                     f"{r.get('step_scale', 1.0):.2f} | {'yes' if r['within'] else 'no'} |")
    auto = [r for r in done if r.get("real_drafted_share") is not None and r["scenario"] == "smartspec"]
    if auto:  # its coordinator ran --speculation auto: the requests it queued for a drafter
        lines += ["", "SmartSpec's requests queued for a drafter (`--speculation auto`), real against simulated: "
                  + ", ".join(f"{r['point']} {r['real_drafted_share']:.0%}/{r['sim_drafted_share']:.0%}" for r in auto)
                  + "."]
    return lines
