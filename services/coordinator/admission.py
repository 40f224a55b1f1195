"""Admission control: at most ``max_in_flight`` requests inside the coordinator at once.

A request takes a :class:`Slot` before the coordinator even reads its body, so overload costs
almost nothing: over the cap, the client gets 429 with ``Retry-After`` at once instead of a
growing pile of bodies, token lists and event queues in memory. The slot travels with the
request (its Submission owns it once queued) and is released exactly once however the request
ends: finished, failed, timed out, refused, client gone or task cancelled. ``Slot.release`` is
idempotent, so every cleanup path may call it without double-counting.
"""

from __future__ import annotations

from prometheus_client import Gauge

from services.coordinator.errors import service_unavailable, too_many_requests
from shared.log import get_logger

log = get_logger("coordinator.admission")


class Slot:
    """One admitted request's place under the cap."""

    __slots__ = ("_limit", "_released")

    def __init__(self, limit: InFlightLimit) -> None:
        self._limit = limit
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the place back; later calls do nothing. Never awaits (safe in cancelled tasks)."""
        if not self._released:
            self._released = True
            self._limit._release()


class InFlightLimit:
    """Counts admitted requests; refuses with 429 at ``max_in_flight`` (0: no limit)."""

    def __init__(self, max_in_flight: int, retry_after_s: int, gauge: Gauge | None = None) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0 (0: no limit), got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self._gauge = gauge
        self._count = 0
        self.draining = False  # shutting down: refuse every new request with 503

    @property
    def in_flight(self) -> int:
        return self._count

    def admit(self) -> Slot:
        """A slot for one more request, or ApiError 429 (with Retry-After) when the cap is reached, or
        503 while the coordinator drains before it exits."""
        if self.draining:
            raise service_unavailable("The coordinator is shutting down and takes no new requests; "
                                      "send the request to another coordinator, or retry once it is back.")
        if self.max_in_flight and self._count >= self.max_in_flight:
            log.debug("request refused: in-flight cap reached", max_in_flight=self.max_in_flight)
            raise too_many_requests(
                f"The coordinator is at its limit of {self.max_in_flight} requests in flight. "
                f"Retry after {self.retry_after_s} s, send fewer concurrent requests, "
                "or raise the coordinator's --max-in-flight.",
                self.retry_after_s,
            )
        self._count += 1
        self._publish()
        return Slot(self)

    def _release(self) -> None:
        self._count -= 1  # never below 0: each Slot adds 1 once and takes it back at most once
        self._publish()

    def _publish(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self._count)
