"""A discrete-event simulator of a specfleet fleet: N edge drafters and one verifier.

It runs the real policies (``services.verifier.allocation`` allocators,
``services.verifier.batching`` batchers, ``services.drafter.control`` controllers) over
simulated time, with time from cost models: the verifier's profiled step-time estimator or an
H100 roofline projection (``costs.py``), per-drafter draft costs and RTTs (``spec.py``), and
synthetic draft tokens whose acceptance follows each drafter's α (``tokens.py``). Drafters
draft their ready sessions in batches and may pipeline (draft a round ahead), as the real
ones do (``engine.py``). It answers
what the testbed cannot: how the policies behave, and what choosing costs, with 10,000 drafters.

    from bench.sim import SimSpec, make_fleet, simulate
    result = simulate(SimSpec(drafters=make_fleet([0.5, 0.8])))

``python -m bench sim`` sweeps fleet sizes and cost models (``__main__.py``).
"""

from bench.sim.costs import COST_MODELS, CostModel, CostSpec, GpuSpec, H100Cost, TransformerShape, load_cpu_coef
from bench.sim.engine import Simulation, simulate
from bench.sim.result import WALL_CLOCK_FIELDS, SimResult
from bench.sim.spec import DrafterSpec, Policies, SimSpec, VerifierSpec, make_fleet, parse_alphas


def main(argv: list[str] | None = None) -> int:
    """``python -m bench sim`` (the CLI lives in ``bench/sim/__main__.py``)."""
    from bench.sim.__main__ import main as cli

    return cli(argv)


__all__ = ["COST_MODELS", "WALL_CLOCK_FIELDS", "CostModel", "CostSpec", "DrafterSpec", "GpuSpec", "H100Cost",
           "Policies", "SimResult", "SimSpec", "Simulation", "TransformerShape", "VerifierSpec",
           "load_cpu_coef", "main", "make_fleet", "parse_alphas", "simulate"]
