"""Drafters that share CPU cores (``SimSpec.edge_cores``): processor sharing, as the OS
time-slices processes that are runnable together.

Each draft-model batch or lookahead step is a job with a given amount of work (CPU seconds).
While n jobs run, each advances at ``min(1, cores / (n + background))`` CPU seconds per second,
where ``background`` stands for the cores' other work (the coordinator, the clients, delay
proxies, the drafters' own event loops) as that many always-running jobs' worth. So a drafter's
batch takes longer while another drafter computes: the waits the verifier sees from each drafter
spread as their computations overlap or not. With ``edge_cores`` 0 the simulator gives every
drafter a device of its own (each batch takes its work in wall time), as at real edge sites.

The set of running jobs changes only when one starts or ends; at each change the remaining work
of every job is brought up to date and the next ending is scheduled as an ``EDGE_CPU`` event
that carries a version, so that an ending scheduled before the change is ignored.
"""

from __future__ import annotations

import itertools
from typing import Any

from bench.sim.state import Events, Kind

#: work left (CPU seconds) below which a job counts as done (floating-point rounding of the sums)
DONE_EPS = 1e-12


class SharedCores:
    """The jobs running on ``cores`` shared CPU cores; see the module docstring."""

    def __init__(self, cores: float, background: float, events: Events) -> None:
        if cores <= 0 or background < 0:
            raise ValueError(f"shared cores need cores > 0 and background >= 0, got {cores} and {background}")
        self.cores, self.background, self.events = cores, background, events
        self.jobs: dict[int, tuple[float, Kind, Any]] = {}  # id -> (work left, event kind at its end, payload)
        self.since = 0.0  # when the work left was last brought up to date
        self.version = 0  # of the scheduled EDGE_CPU event; an older one is stale
        self._ids = itertools.count()
        self.busy_s = 0.0  # wall seconds with any job running
        self.work_s = 0.0  # CPU seconds of finished jobs

    def rate(self) -> float:
        """CPU seconds per second each running job gets."""
        return min(1.0, self.cores / (len(self.jobs) + self.background)) if self.jobs else 1.0

    def start(self, now: float, work: float, kind: Kind, payload: Any) -> None:
        """A job of ``work`` CPU seconds starts; ``kind`` with ``payload`` is handled when it ends."""
        self._advance(now)
        self.jobs[next(self._ids)] = (max(0.0, work), kind, payload)
        self._schedule(now)

    def finish(self, version: int, now: float) -> list[tuple[Kind, Any]]:
        """The jobs that end at ``now`` (none if ``version`` is stale), in the order they started."""
        if version != self.version:
            return []
        self._advance(now)
        ended = [i for i, (left, _, _) in self.jobs.items() if left <= DONE_EPS]
        done = [self.jobs.pop(i)[1:] for i in ended]
        self._schedule(now)
        return done

    def _advance(self, now: float) -> None:
        elapsed = now - self.since
        if self.jobs and elapsed > 0:
            step = elapsed * self.rate()
            self.jobs = {i: (left - step, kind, p) for i, (left, kind, p) in self.jobs.items()}
            self.busy_s += elapsed
            self.work_s += step * len(self.jobs)
        self.since = now

    def _schedule(self, now: float) -> None:
        self.version += 1
        if self.jobs:
            left = min(left for left, _, _ in self.jobs.values())
            self.events.push(now + max(0.0, left) / self.rate(), Kind.EDGE_CPU, self.version)


__all__ = ["SharedCores"]
