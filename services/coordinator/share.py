"""Taking a share of new requests, spread evenly: with share 1/4, every fourth one.

The coordinator routes new requests to drafters at the share the verifier's draft-length policy
asks for (``FleetStatus.draft_share``); the simulator routes its requests with the same class."""

from __future__ import annotations


class EvenShare:
    """Credit accumulates by the share at each request; a request is taken when it reaches 1.
    Capped at 1, so a share that rises after a long spell at 0 takes no burst of requests."""

    def __init__(self) -> None:
        self.credit = 0.0

    def take(self, share: float) -> bool:
        self.credit = min(1.0, self.credit + share)
        if self.credit < 1.0:
            return False
        self.credit -= 1.0
        return True
