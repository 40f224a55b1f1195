"""``python -m bench <command>``: profile, serving, context, qwire, policies (make bench), costs,
verifier-policies, backends, rtt, single, fairness, slo, load, capacity, sim, sim-validate, sim-rtt,
sim-jetson, invariance, report, oracle-record, gpu-check, edge-drafts, fidelity, decode, dashboard-picture, real,
draft-steps, row-costs, draft-rounds."""

from __future__ import annotations

import importlib
import signal
import sys

COMMANDS = {"profile": "bench.profile", "serving": "bench.serving", "context": "bench.context",
            "qwire": "bench.qwire", "policies": "bench.policies", "costs": "bench.costs",
            "verifier-policies": "bench.verifier_policies", "backends": "bench.backends", "rtt": "bench.rtt",
            "single": "bench.single", "fairness": "bench.fairness", "slo": "bench.slo", "load": "bench.load",
            "capacity": "bench.capacity", "report": "bench.report", "invariance": "bench.invariance",
            "sim": "bench.sim", "sim-validate": "bench.sim.validate", "sim-rtt": "bench.sim.rtt_sweep",
            "sim-jetson": "bench.sim.jetson_h100",
            "oracle-record": "bench.oracle", "gpu-check": "bench.gpu_check", "edge-drafts": "bench.edge_drafts",
            "fidelity": "bench.fidelity", "decode": "bench.decode", "dashboard-picture": "bench.dashboard_picture",
            "real": "bench.real", "draft-steps": "bench.draft_steps", "row-costs": "bench.row_costs",
            "draft-rounds": "bench.draft_rounds"}


USAGE = f"usage: python -m bench {{{','.join(COMMANDS)}}} [flags]  (--help after a command for its flags)"


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        unknown = f"python -m bench: unknown command {sys.argv[1]!r}\n" if len(sys.argv) >= 2 else ""
        print(f"{unknown}{USAGE}", file=sys.stderr)
        return 2
    # a kill (SIGTERM) unwinds like Ctrl-C: fleets stop, edge namespaces and proxies are removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    module = importlib.import_module(COMMANDS[sys.argv[1]])
    return int(module.main(sys.argv[2:]))


if __name__ == "__main__":
    raise SystemExit(main())
