"""Stopping a VerifierPool fails its requests once; it does not first move them from each link it
stops to the links still up (each would re-open them on a verifier just before that link stops too)."""

from __future__ import annotations

import pytest

from services.coordinator.verifier_pool import VerifierPool
from shared.protocol import OpenSession, SamplingParams

pytestmark = pytest.mark.asyncio


def _pool_with_a_request_on(replica: int) -> VerifierPool:
    pool = VerifierPool(["ws://127.0.0.1:9/a", "ws://127.0.0.1:9/b"], "c")
    for link in pool.links:
        link._up.set()  # as after a Welcome
    pool.subscribe("r", OpenSession(request_id="r", prompt_ids=[1], params=SamplingParams(), origin="c"))
    pool.routing.where["r"] = replica
    return pool


async def test_a_lost_replica_moves_its_requests() -> None:
    pool = _pool_with_a_request_on(0)
    pool.links[0]._down("gone")
    assert pool.routing.where["r"] == 1 and pool.links[1]._outbox.qsize() == 1


async def test_stop_moves_nothing_and_fails_the_requests() -> None:
    pool = _pool_with_a_request_on(0)
    queue = pool.routing.subs["r"]
    await pool.stop()
    assert all(link._outbox.qsize() == 0 for link in pool.links)
    final = queue.get_nowait().event
    assert final.finished and final.finish_reason == "cancelled" and queue.empty()
