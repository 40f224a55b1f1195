"""Run a statistical test's seeds on every core: each seed is an independent experiment.

``over_seeds(count, n)`` splits ``range(n)`` into strided shares, one per worker process, calls
``count(share)`` (a module-level function returning a tensor of counts) in each, and sums the
results. The counts are exactly those of one loop over ``range(n)``; only the wall time changes.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

WORKERS = max(1, min(2, os.cpu_count() or 1))
#: ``make test-stat-full`` (SPECFLEET_STAT_FULL=1): the controls, and the coupled-bonus check, at
#: twice the seeds of the default run
FULL = os.environ.get("SPECFLEET_STAT_FULL", "") == "1"


def _one_thread() -> None:
    torch.set_num_threads(1)


@functools.cache
def _pool(workers: int) -> ProcessPoolExecutor:
    """One pool for the whole run: its workers import torch and the services once."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's threads
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread)
    atexit.register(pool.shutdown)
    return pool


def over_seeds(count: Callable[[range], torch.Tensor], seeds: int, workers: int = WORKERS) -> torch.Tensor:
    """The sum of ``count`` over ``range(seeds)``, the seeds shared out among ``workers`` processes."""
    shares = [range(w, seeds, workers) for w in range(workers)]
    if workers == 1:
        return count(shares[0])
    return torch.stack(list(_pool(workers).map(count, shares))).sum(dim=0)
