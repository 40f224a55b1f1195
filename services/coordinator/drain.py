"""Graceful shutdown, as vLLM's shutdown tests expect: drain, then exit 0.

On the first SIGTERM (or SIGINT) the coordinator keeps its port open but takes no new request
(503 in the OpenAI error shape, and ``/ready`` answers 503 so a load balancer stops sending),
lets every in-flight request finish for up to ``--drain-timeout-s``, and then lets uvicorn stop.
A second signal stops at once. The process then exits 0.
"""

from __future__ import annotations

import asyncio
import time
from types import FrameType

import uvicorn

from services.coordinator.admission import InFlightLimit
from shared.log import get_logger

log = get_logger("coordinator.drain")
POLL_S = 0.1


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal asks for a drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drain_requested = asyncio.Event()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise them after serving, and the
        # process would then die of the signal instead of exiting 0 after a clean drain.
        if not self.drain_requested.is_set() and not self.should_exit:
            self.drain_requested.set()
        elif self.should_exit:
            self.force_exit = True
        else:
            self.should_exit = True


async def drain_on_signal(server: DrainingServer, admission: InFlightLimit, timeout_s: float) -> None:
    """Wait for the drain signal; refuse new requests, wait for in-flight ones (up to ``timeout_s``),
    then tell the server to stop."""
    await server.drain_requested.wait()
    admission.draining = True
    deadline = time.monotonic() + timeout_s
    log.warning("draining: new requests are refused", in_flight=admission.in_flight, timeout_s=timeout_s)
    while admission.in_flight > 0 and time.monotonic() < deadline and not server.should_exit:
        await asyncio.sleep(POLL_S)
    if admission.in_flight > 0:
        log.warning("drain deadline reached; stopping with requests in flight", in_flight=admission.in_flight)
    else:
        log.info("drained: every in-flight request finished")
    server.should_exit = True
