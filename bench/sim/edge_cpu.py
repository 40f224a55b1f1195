"""Drafters that share CPU cores (``SimSpec.edge_cores``): processor sharing, as the OS
time-slices processes that are runnable together.

Each draft-model batch or lookahead step is a job with a given amount of work (CPU seconds).
While n jobs run, each advances at ``min(1, cores / (n + background))`` CPU seconds per second,
where ``background`` stands for the cores' other work (the coordinator, the clients, delay
proxies, the drafters' own event loops) as that many always-running jobs' worth. So a drafter's
batch takes longer while another drafter computes: the waits the verifier sees from each drafter
spread as their computations overlap or not. With ``edge_cores`` 0 the simulator gives every
drafter a device of its own (each batch takes its work in wall time), as at real edge sites.

All running jobs advance at the same rate, so the cores keep one virtual clock: the CPU seconds
each running job has received so far. A job ends when that clock reaches its start reading plus
its work; the running jobs sit in a heap by that end reading. The next ending is scheduled as an
``EDGE_CPU`` event that carries a version, so that an ending scheduled before a job started (and
slowed the others) is ignored.
"""

from __future__ import annotations

import heapq
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
        #: (virtual clock when it ends, start order, event kind at its end, payload) per running job
        self.jobs: list[tuple[float, int, Kind, Any]] = []
        self.virtual = 0.0  # CPU seconds each running job has received (see the module docstring)
        self.since = 0.0  # when ``virtual`` was last brought up to date
        self.version = 0  # of the scheduled EDGE_CPU event; an older one is stale
        self._order = itertools.count()

    def rate(self) -> float:
        """CPU seconds per second each running job gets."""
        return min(1.0, self.cores / (len(self.jobs) + self.background)) if self.jobs else 1.0

    def start(self, now: float, work: float, kind: Kind, payload: Any) -> None:
        """A job of ``work`` CPU seconds starts; ``kind`` with ``payload`` is handled when it ends."""
        self._advance(now)
        heapq.heappush(self.jobs, (self.virtual + max(0.0, work), next(self._order), kind, payload))
        self._schedule(now)

    def finish(self, version: int, now: float) -> list[tuple[Kind, Any]]:
        """The jobs that end at ``now`` (none if ``version`` is stale), in the order they started."""
        if version != self.version:
            return []
        self._advance(now)
        done = []
        while self.jobs and self.jobs[0][0] <= self.virtual + DONE_EPS:
            done.append(heapq.heappop(self.jobs))
        self._schedule(now)
        return [(kind, payload) for _, _, kind, payload in sorted(done, key=lambda job: job[1])]

    def _advance(self, now: float) -> None:
        if self.jobs and now > self.since:
            self.virtual += (now - self.since) * self.rate()
        self.since = now

    def _schedule(self, now: float) -> None:
        self.version += 1
        if self.jobs:
            left = self.jobs[0][0] - self.virtual
            self.events.push(now + max(0.0, left) / self.rate(), Kind.EDGE_CPU, self.version)


__all__ = ["SharedCores"]
