"""Live prefix sharing: a request copies the KV rows of a prompt prefix another live request has
already computed, instead of computing them again.

``n`` > 1 opens n sessions with the same prompt, and chat requests often open with the same
system prompt. Each step, before scheduling:

1. :func:`copy_shared`: every request that still has prompt to prefill takes the longest prefix
   some other live request holds in its KV slot (``KVArena.share``, a memory copy);
2. :func:`followers`: a request whose next uncached rows an *older* live request is about to
   compute (at least ``MIN_SHARED`` of them) sits this step out, so that one forward computes
   them once and the copy of step 1 hands them on. The oldest of a group never waits.

Rows are copied, never aliased: each session's slot stays its own, so rollback and freeing work
as before. Outputs do not change: the rows hold the same tokens at the same positions.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.verifier.requests import Request
from shared.prefix import common_prefix_len
from shared.runner.kv import KVArena

#: shared rows below this are recomputed rather than waited for (a step's delay is not worth it)
MIN_SHARED = 16


def _shared(a: Request, b: Request) -> int:
    """Leading committed tokens ``b`` may take from ``a``: all but ``b``'s last (every round feeds it)."""
    if a.committed[:MIN_SHARED] != b.committed[:MIN_SHARED]:  # the common case, in C
        return 0
    return min(common_prefix_len(a.committed, b.committed), len(b.committed) - 1)


def copy_shared(requests: Iterable[Request], kv: KVArena) -> int:
    """Copy into each request still prefilling the longest prefix another live request has
    cached; returns the rows copied."""
    live = [r for r in requests if r.slot is not None]
    copied = 0
    for req in live:
        if req.to_prefill < MIN_SHARED:
            continue
        best, donor = req.cached, None
        for other in live:
            if other is not req and other.cached > best and (n := min(_shared(other, req), other.cached)) > best:
                best, donor = n, other
        if donor is not None and best - req.cached >= MIN_SHARED:
            assert donor.slot is not None and req.slot is not None
            copied += best - req.cached
            kv.share(donor.slot, req.slot, best)
    return copied


def followers(requests: Iterable[Request]) -> set[int]:
    """``id()`` of the requests to hold out of this step: an older live request (not held itself,
    still prefilling) will compute at least ``MIN_SHARED`` rows they share and do not hold yet."""
    live = sorted((r for r in requests if r.slot is not None), key=lambda r: r.arrived_at)
    held: set[int] = set()
    for i, req in enumerate(live):
        if req.to_prefill < MIN_SHARED:
            continue
        for leader in live[:i]:
            if id(leader) in held or leader.to_prefill <= 0:  # only a leader that computes rows this step
                continue
            if leader.cached < (n := _shared(leader, req)) and n - req.cached >= MIN_SHARED:
                held.add(id(req))
                break
    return held
