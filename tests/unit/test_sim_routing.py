"""The simulator's ``--speculation auto``: new requests get a drafter for the share the real
allocator asks for (SmartSpec's switch-off), the rest are opened target-only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim import CostSpec, DrafterSpec, Policies, SimSpec, simulate

#: a busy CPU verifier: 48 sessions at a time, drafts rarely accepted, a slow edge; plain decoding wins
BUSY = SimSpec(drafters=(DrafterSpec("d0", alpha=0.3, rtt_s=0.01, token_s=2e-3, concurrency=48, max_tokens=24,
                                     prompt_len=32, requests=600),),
               policies=Policies(allocation="smartspec", draft_len=4, smartspec_max_len=4), cost=CostSpec("cpu"),
               rounds=None, duration_s=600.0)


@pytest.mark.parametrize("auto", [False, True])
def test_auto_sends_only_smartspecs_probes_to_the_drafters_when_plain_decoding_wins(auto: bool) -> None:
    r = simulate(replace(BUSY, auto=auto))
    assert r.requests_done == 600
    assert r.drafted_share is not None
    if auto:
        assert r.drafted_share < 0.3  # the warm-up's requests, and the tries after the waits expire
    else:
        assert r.drafted_share == 1.0


def test_auto_drafts_for_every_request_where_speculation_pays() -> None:
    easy = replace(BUSY.drafters[0], alpha=0.9, rtt_s=0.002, token_s=0.2e-3, concurrency=1, requests=40)
    r = simulate(replace(BUSY, drafters=(easy,), auto=True))
    assert r.requests_done == 40 and r.drafted_share == 1.0
