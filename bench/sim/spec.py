"""The scenario a simulation runs: drafters, their requests, the policies, the limits and the cost model.

Everything is a frozen dataclass of plain values, so a spec can be written to JSON, compared, and
built by another module from a real run's measured parameters (acceptance rates, draft costs,
RTTs, the profiled estimator) to check the simulator against that run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.sim.costs import CostSpec
from bench.sim.spread import Spread


@dataclass(frozen=True)
class DrafterSpec:
    """One edge drafter (one draft model drafting its ready sessions in batches of up to
    ``max_batch``) and the requests it serves.

    Costs: a batch runs one forward of the draft model per draft position, each costing
    ``forward_s`` whatever its rows, and a session's draft of j tokens adds ``round_s + j·token_s``
    to the batch's time (the first round of a request also prefills its prompt:
    ``prompt_len·prefill_token_s``): a batch of n sessions drafting k each takes
    ``k·forward_s + n·(round_s + k·token_s)``. ``token_s`` is the draft model's time per token
    and row, ``round_s`` a fixed cost per drafted round (scheduling, sampling setup). With
    ``forward_s`` 0, ``token_s`` stands for the time per token at the batch sizes the drafter sees
    (its forwards' fixed cost amortised over their rows). A token of each of n lookaheads drafted
    together costs ``n·lookahead_token_s`` (measured at the lookahead batches a drafter runs, one
    or two sessions, so with the fixed cost in it), or one forward, ``forward_s + n·token_s``, when
    that is 0. Each
    draft leaves ``send_s`` after its batch ends (the hand-off: turning the batch into frames,
    which does not hold the draft model up).
    A message takes ``rtt_s / 2`` each way between the drafter and the verifier.

    Requests: closed loop with ``concurrency`` sessions at once (a finished request is followed at
    once by the next one, no think time; ``requests`` > 0 ends the loop after that many) unless
    ``arrivals`` lists request arrival times (seconds; open loop, each arrival one request). A
    closed loop's first requests start at ``starts`` (seconds, one per session; all at 0 when
    empty): the real client connects its sockets inside the run, and sends each first request once
    its socket is up, so they reach the queue over tens to hundreds of milliseconds. Every request
    has ``prompt_len`` prompt tokens, asks for ``max_tokens`` output tokens and carries the SLO
    class ``slo_tokens_per_s`` (None: best effort).
    """

    name: str
    alpha: float = 0.7  # mean per-token acceptance probability of its draft model against the target
    token_s: float = 1e-3  # draft model seconds per drafted token
    forward_s: float = 0.0  # draft model fixed seconds per forward of a batch, whatever its rows
    round_s: float = 5e-4  # fixed draft-model cost per drafted round (scheduling, sampling setup)
    prefill_token_s: float = 5e-5  # draft model seconds per prompt token, first round of a request
    send_s: float = 0.0  # from a batch's end to each of its drafts leaving (the drafter's hand-off)
    rtt_s: float = 0.02  # round-trip time to the verifier
    #: a uniform extra delay in [0, jitter_s] on each draft and verdict, one way (a message never
    #: overtakes the one before it in its direction: one connection)
    jitter_s: float = 0.0
    #: measured spreads (``spread.py``): each round batch's draft-model time and each draft's
    #: hand-off (``send_s``) times a factor of mean 1 drawn from them; None: always the mean
    draft_spread: Spread | None = None
    send_spread: Spread | None = None
    #: a round batch's drafts leave one after another, as the real drafter's session tasks send
    #: them in turn: the i-th (from 0) after i + 1 hand-offs of 2·send_s/(send_rows + 1), so that at
    #: batches of ``send_rows`` sessions (the real ones' mean) they leave ``send_s`` after the batch
    #: on average; 0: every draft of a batch leaves ``send_s`` after it
    send_rows: float = 0.0
    max_batch: int = 64  # the most sessions drafted together (the real drafter: its session limit)
    #: pipelined drafting (the real drafter's --pipeline-sessions): a session that sends a draft
    #: while its drafter serves at most this many sessions drafts its next round ahead (a guess of
    #: the verifier's bonus token, then as many drafts as it asked for) as if all of this one is
    #: accepted, one token per batch and only when no round is ready; 0: off. Alternative
    #: lookaheads (--lookahead-branches) are not modelled.
    pipeline_sessions: int = 0
    #: a lookahead drafted before the verdict it assumes goes to the verifier at once, as the next
    #: round's conditional draft (``Draft.after``), which the verifier verifies as soon as that verdict
    #: comes true, with no round trip to the drafter (the real drafter does this whenever the
    #: verifier offers it, as both backends do); False: it waits at the drafter for its verdict
    conditional: bool = True
    lookahead_token_s: float = 0.0  # draft-model seconds per lookahead token (0: a forward's share)
    #: the chance its proposer has each next draft token, having had the one before (a model-free
    #: drafter proposes only as far as its match goes); a round asked for k drafts j or more with
    #: probability proposal_rate^j. 1: a draft model, which drafts all k
    proposal_rate: float = 1.0
    concurrency: int = 1
    requests: int = 0  # closed loop: stop after this many requests in all (0: never)
    arrivals: tuple[float, ...] = ()
    starts: tuple[float, ...] = ()  # closed loop: when its first requests start (see above)
    prompt_len: int = 64
    max_tokens: int = 32
    slo_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0 or not 0.0 <= self.proposal_rate <= 1.0:
            raise ValueError(f"{self.name}: alpha and proposal_rate must be in [0, 1], got {self.alpha} and "
                             f"{self.proposal_rate}")
        if min(self.token_s, self.forward_s, self.round_s, self.prefill_token_s, self.send_s, self.lookahead_token_s,
               self.rtt_s, self.jitter_s, self.send_rows, *self.starts) < 0:
            raise ValueError(f"{self.name}: costs and RTT must be >= 0")
        if min(self.concurrency, self.max_batch, self.prompt_len, self.max_tokens) < 1 or min(
                self.requests, self.pipeline_sessions) < 0:
            raise ValueError(f"{self.name}: concurrency, max_batch, prompt_len and max_tokens must be >= 1, "
                             "requests and pipeline_sessions >= 0")


@dataclass(frozen=True)
class Policies:
    """The real policies to run, by the names the verifier and drafter take (``--allocation``,
    ``--batching``, ``--controller``), with their tunables (defaults as the services' own)."""

    allocation: str = "fixed"
    batching: str = "fcfs"
    controller: str = "fixed"
    draft_len: int = 4  # Fixed-S's k and the adaptive allocators' first length
    capacity: int = 0  # GoodSpeed's C (0: draft_len per speculating session)
    max_draft_tokens: int = 16  # no budget above this
    smartspec_max_len: int = 8  # SmartSpec's V (capped by max_draft_tokens)
    threshold: float = 0.4  # the threshold controller's confidence threshold
    default_slo_tokens_per_s: float | None = None  # WISP's target for requests without an SLO class
    wisp_delta_s: float = 0.02  # WISP's guard time δ
    wisp_network_s: float = 0.0  # WISP's T_net (the verifier's --wisp-network-ms)
    goodspeed_eta: float = 0.1  # tracker smoothing of α̂ (eq. 3)
    goodspeed_beta: float = 0.5  # tracker smoothing of X (eq. 4)

    @property
    def allocation_max_len(self) -> int:
        """The ``max_len`` the verifier gives its allocator (services/verifier/main.py)."""
        if self.allocation == "smartspec":
            return min(self.max_draft_tokens, self.smartspec_max_len)
        return self.max_draft_tokens


@dataclass(frozen=True)
class VerifierSpec:
    """The verifier's step limits and fixed overheads beyond the model's forward."""

    max_sessions: int = 256  # BatchLimits.max_sessions
    max_tokens: int = 8192  # BatchLimits.max_tokens
    step_overhead_s: float = 5e-4  # per step: event loop, scheduling bookkeeping
    round_overhead_s: float = 5e-5  # per session verified in a step: judging, (de)serialising its messages
    #: decode sessions whose drafts travel when a step has nothing to verify, as the real verifier
    #: does by default (``--fill``); off by default here: with it the simulator filled more than the
    #: real verifier of the runs before 2026-12-03 did and missed them (bench/commentary/sim-validation.md)
    fill: bool = False
    #: with ``fill``: also decode them as riders in steps that verify others (the real
    #: ``--fill-riders``, its default since 2026-12-03); False: only in steps with nothing to verify
    riders: bool = True


@dataclass(frozen=True)
class SimSpec:
    """A whole scenario. ``speculative`` False runs target-only: no draft model, every round
    commits one token, the drafters only stand for clients with their RTT and requests.

    The run stops at whichever comes first: ``rounds`` verified rounds per drafter on average
    (Σ rounds ≥ rounds·len(drafters)), ``duration_s`` simulated seconds, or no work left.
    ``alpha_concentration`` κ shapes the per-token acceptance probabilities (``tokens.py``).
    """

    drafters: tuple[DrafterSpec, ...]
    policies: Policies = field(default_factory=Policies)
    verifier: VerifierSpec = field(default_factory=VerifierSpec)
    cost: CostSpec = field(default_factory=CostSpec)
    speculative: bool = True
    #: the coordinator's ``--speculation auto``: each new request gets a drafter with the share
    #: the allocator asks for (``draft_share``: SmartSpec's switch-off), the others go target-only
    auto: bool = False
    rounds: int | None = 16
    duration_s: float | None = None
    alpha_concentration: float = 4.0
    seed: int = 0
    #: closed loop through one queue (the real fleets' request queue): > 0 makes the drafters draw
    #: this many requests in all from one pool, a drafter starting the next one the moment one of
    #: its own finishes (so faster drafters serve more); 0: each drafter serves its own ``requests``
    shared_requests: int = 0
    #: drafters sharing this many CPU cores, as on this machine's pinned edge core (0: each drafter
    #: on a device of its own, as at real edge sites). Then the drafters' draft-model costs are CPU
    #: seconds, and their batches and lookahead steps share the cores equally while they run
    #: together (``edge_cpu.py``)
    edge_cores: float = 0.0
    #: with ``edge_cores``: the cores' other work (coordinator, clients, proxies, the drafters' event
    #: loops) as this many always-running jobs' worth, i.e. its CPU seconds per second
    edge_background: float = 0.0

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("a simulation needs at least one drafter (client)")
        if self.shared_requests < 0:
            raise ValueError("shared_requests must be >= 0")
        if self.shared_requests and any(d.arrivals for d in self.drafters):
            raise ValueError("shared_requests is a closed loop: drafters with arrivals cannot share a pool")
        if self.rounds is None and self.duration_s is None:
            raise ValueError("bound the run: set rounds or duration_s")
        if self.alpha_concentration <= 0:
            raise ValueError("alpha_concentration must be > 0")
        if self.edge_cores < 0 or self.edge_background < 0:
            raise ValueError("edge_cores and edge_background must be >= 0")
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError("drafter names must be unique")

    def target_only(self, duration_s: float) -> SimSpec:
        """The same fleet and seed served without speculation for ``duration_s`` simulated seconds
        (a speculative run's time, for its speed-up)."""
        return replace(self, speculative=False, rounds=None, duration_s=duration_s)


def parse_values(text: str, n: int, spread: tuple[float, float]) -> list[float]:
    """n per-drafter values from a CLI value: ``0.7`` (all the same), ``0.5,0.9`` (cycled),
    ``spread`` (evenly over the ``spread`` range, first to last drafter) or ``spread:LO:HI``."""
    text = text.strip()
    if text.startswith("spread"):
        parts = text.split(":")
        if len(parts) not in (1, 3):
            raise ValueError(f"expected spread or spread:LO:HI, got {text!r}")
        lo, hi = (float(parts[1]), float(parts[2])) if len(parts) == 3 else spread
        return [lo + (hi - lo) * i / (n - 1) if n > 1 else (lo + hi) / 2 for i in range(n)]
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values:
        raise ValueError(f"no values in {text!r}")
    return [values[i % len(values)] for i in range(n)]


def number_list(text: str, kind: Callable[[str], Any], least: float) -> list[Any]:
    """A CLI list such as ``1,2,4`` (an argparse type): each value a ``kind`` of at least ``least``."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers >= {least:g}, got {text!r}")
    return values


def parse_alphas(text: str, n: int) -> list[float]:
    """Per-drafter α (:func:`parse_values`; ``spread`` is 0.3 to 0.9)."""
    return parse_values(text, n, (0.3, 0.9))


def make_fleet(alphas: Sequence[float], template: DrafterSpec | None = None) -> tuple[DrafterSpec, ...]:
    """One drafter per α, named d0, d1, ..., with the other fields of ``template``."""
    base = template or DrafterSpec(name="d")
    return tuple(replace(base, name=f"d{i}", alpha=a) for i, a in enumerate(alphas))
