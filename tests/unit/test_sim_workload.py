"""The validation reads the round trip a real run's edge network added from its rows, and gives
each simulated drafter at least that round trip."""

from __future__ import annotations

import pytest

from bench.sim.validate import drafters_of
from bench.sim.workload import configured_rtt_ms
from tests.unit.test_bench_scenarios import real_row


@pytest.mark.parametrize(("network", "want"), [
    ("edge network: netns, RTT +40 ms", 40.0),
    ("edge network: loopback+proxy, RTT +10 ms, 100 Mbit/s each way", 10.0),
    ("edge network: netns, RTT +0 ms, verifier-1 +0 ms, verifier-2 +10 ms", 0.0),  # the fleet's, not a drafter's
    ("edge network: netns, RTT +2.5 ms", 2.5),
    ("loopback", 0.0),
    (None, 0.0),  # an older row without the field
])
def test_the_configured_round_trip_is_read_from_the_network(network: str | None, want: float) -> None:
    row = {**real_row(), **({"network": network} if network is not None else {})}
    assert configured_rtt_ms(row) == want


def test_a_drafter_gets_the_configured_round_trip_when_its_measured_link_is_shorter() -> None:
    row = {**real_row(), "scenario": "specfleet", "network": "edge network: netns, RTT +40 ms"}
    assert [d.rtt_s for d in drafters_of("capacity", row, {})] == pytest.approx([0.04, 0.04])
    loopback = {**row, "network": "loopback"}
    assert all(d.rtt_s < 0.04 for d in drafters_of("capacity", loopback, {}))
