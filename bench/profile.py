"""Where a round's time goes: ``python -m bench profile``.

Starts a pinned fleet (verifier on the server CPUs; coordinator, one drafter and the load
client on the edge CPUs), sends greedy requests at each ``--concurrency``, and prints the mean
time per round and per step of every phase the services measure (their Prometheus histograms),
side by side. Use it before and after a change to the round's machinery.

    python -m bench profile [--concurrency 1,16] [--requests 8] [--max-tokens 128] [--target DIR] [--draft DIR]
                            [--verifier-flags '--fill false'] [--drafter-flags '...']
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

from bench.edge import add_edge_flags, edge_from
from bench.fleets import Run, Scenario, bench_fleet, drafters_of, measure
from shared.up import resolve_models

V = "specfleet_verifier"
D = "specfleet_drafter"
C = "specfleet_coordinator"


def breakdown(run: Run) -> list[tuple[str, float, str]]:
    """(phase, mean milliseconds, what it is) rows for one run."""
    v, d, c = run.metrics["verifier"], drafters_of(run), run.metrics.get("coordinator")
    ms = 1e3
    rows = [
        ("drafter: wait for the compute worker", d.mean(f"{D}_round_phase_seconds", phase="worker_wait") * ms, "round"),
        ("drafter: draft compute", d.mean(f"{D}_round_phase_seconds", phase="draft") * ms, "round"),
        ("drafter: hand-off and send", d.mean(f"{D}_round_phase_seconds", phase="send") * ms, "round"),
        ("drafter: wait for the verdict", d.mean(f"{D}_round_phase_seconds", phase="verify_wait") * ms, "round"),
        ("drafter: whole round", d.mean(f"{D}_round_phase_seconds", phase="round") * ms, "round"),
        ("verifier: draft in -> its step starts", v.mean(f"{V}_queue_wait_seconds") * ms, "round"),
        ("verifier: wait for a draft", v.mean(f"{V}_draft_wait_seconds") * ms, "round"),
        ("verifier: schedule", v.mean(f"{V}_step_seconds", phase="schedule") * ms, "step"),
        ("verifier: forward", v.mean(f"{V}_step_seconds", phase="forward") * ms, "step"),
        ("verifier: accept + commit", v.mean(f"{V}_step_seconds", phase="accept") * ms, "step"),
        ("verifier: publish (results -> frames)", v.mean(f"{V}_publish_seconds") * ms, "step"),
        ("verifier: step period (start to start)", v.mean(f"{V}_step_period_seconds") * ms, "step"),
    ]
    if c is not None and c.count(f"{C}_relay_seconds"):
        rows.append(("coordinator: relay (verifier frame -> client)", c.mean(f"{C}_relay_seconds") * ms, "event"))
    inside = (v.mean(f"{V}_queue_wait_seconds") + v.mean(f"{V}_step_seconds", phase="total")
              + v.mean(f"{V}_publish_seconds")) * ms
    rows.append(("derived: network + event loops (verdict wait - verifier)",
                 d.mean(f"{D}_round_phase_seconds", phase="verify_wait") * ms - inside, "round"))
    return rows


def report(run: Run) -> str:
    v = run.metrics["verifier"]
    steps = v.count(f"{V}_step_seconds", phase="forward")
    sessions = v.mean(f"{V}_batch_sessions")
    tokens = v.mean(f"{V}_batch_tokens")
    period, forward = v.mean(f"{V}_step_period_seconds"), v.mean(f"{V}_step_seconds", phase="forward")
    lines = [f"## {run.scenario}, {run.concurrency} concurrent: {run.tokens_per_s:.1f} tokens/s, "
             f"acceptance {run.acceptance:.3f}, {steps:.0f} steps of {sessions:.1f} sessions / {tokens:.1f} tokens",
             "", "| phase | mean ms | per |", "|---|---|---|"]
    lines += [f"| {name} | {value:.3f} | {per} |" for name, value, per in breakdown(run)]
    cpu = v.value("process_cpu_seconds_total") / steps if steps else 0.0
    fcpu = v.value(f"{V}_forward_cpu_seconds_total") / steps if steps else 0.0
    if fcpu:
        lines += ["", f"verifier CPU per step {cpu * 1e3:.3f} ms, of which the forward {fcpu * 1e3:.3f} ms: "
                      f"CPU per step / forward CPU = {cpu / fcpu:.3f}; step period / forward = {period / forward:.3f} "
                      "(the period includes waiting for drafts)"]
    d = drafters_of(run)
    used, presented = d.value(f"{D}_lookaheads_total", outcome="used"), d.value(f"{D}_presented_lookaheads_total")
    lines += ["", f"rounds drafted ahead: {used:.0f} lookaheads used, {presented:.0f} of them already at the verifier "
                  f"(conditional drafts); verifier: {v.value(f'{V}_filled_tokens_total'):.0f} tokens filled while "
                  "drafts travelled"]
    if wall := sum(run.walls):
        vcpu = v.value("process_cpu_seconds_total")
        lines += ["", f"busy over the {wall:.2f} s measured: verifier CPU {vcpu / wall:.0%}"
                      f" (its forwards {v.value(f'{V}_step_seconds_sum', phase='forward') / wall:.0%}), drafter CPU "
                      f"{d.value('process_cpu_seconds_total') / wall:.0%} (each has one core: near 100 % is the limit)"]
        if (c := run.metrics.get("coordinator")) is not None:
            lines[-1] += (f"; on the drafter's core also the coordinator, CPU "
                          f"{c.value('process_cpu_seconds_total') / wall:.0%}, and the load client (this process), "
                          f"CPU {run.client_cpu_s / wall:.0%}")
    return "\n".join(lines)


def weight_bytes(model: Path) -> int:
    """A draft's bytes of weights: its GGUF file's size, or its safetensors' in a model directory."""
    if model.is_file():
        return model.stat().st_size
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def smallest(drafts: list[Path]) -> Path:
    """The cheapest draft: the one with the fewest bytes of weights."""
    return min(drafts, key=weight_bytes)


def largest(drafts: list[Path]) -> Path:
    return max(drafts, key=weight_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench profile", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency level (at least the level)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0, help="request temperature (0: greedy)")
    p.add_argument("--target", default="")
    p.add_argument("--draft", default="", help="draft model dir (default: the smallest draft beside the target)")
    p.add_argument("--verifier-flags", default="", help="extra verifier flags, e.g. '--fill false'")
    p.add_argument("--drafter-flags", default="", help="extra drafter flags, e.g. '--conditional-drafts false'")
    add_edge_flags(p)
    args = p.parse_args(argv)
    edge = edge_from(args)
    edge.pin_self_to_edge()
    models = resolve_models(args.target, args.draft, Path.cwd(), Path(".specfleet"))
    sc = Scenario("1 drafter", drafters=1, draft=str(smallest(models.drafts)), draft_len=args.draft_len,
                  verifier_flags=tuple(shlex.split(args.verifier_flags)),
                  drafter_flags=tuple(shlex.split(args.drafter_flags)))
    print(f"# round breakdown ({edge.describe()})\n")
    with tempfile.TemporaryDirectory() as logs, bench_fleet(models.target, sc, edge, Path(logs)) as bf:
        for conc in args.concurrency:
            run = measure(bf, sc, conc, 1, max(args.requests, conc), args.max_tokens, models.target.name,
                          args.temperature)
            print(report(run) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
