"""The event loop's view of each session: whom to tell, its text so far, its counts.

The engine core owns the tokens and the KV cache; this side owns everything that reaches a
peer: which drafter connection gets the per-round Verdicts, which frontend gets the
TokenEvents, the incremental text with its stop strings, and the request ids already served
(a re-delivered request is answered "duplicate").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.verifier.detok import IncrementalText

#: finished request ids remembered, so a re-delivered request is answered "duplicate"
FINISHED_IDS_KEPT = 100_000


@dataclass
class Route:
    request_id: str
    origin: str  # the frontend node that receives TokenEvents
    opener: str  # the connection that sent OpenSession
    drafter: str | None  # connection that gets per-round Verdicts; None when target-only
    owner: str | None  # the drafter connection that opened it: told when it finishes
    prompt_tokens: int
    text: IncrementalText
    # counted as its rounds come back
    completion_tokens: int = field(init=False, default=0)
    drafted: int = field(init=False, default=0)
    accepted: int = field(init=False, default=0)


class Routes:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.open: dict[str, Route] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.open)

    def get(self, request_id: str) -> Route | None:
        return self.open.get(request_id)

    def known(self, request_id: str) -> bool:
        return request_id in self.open or request_id in self._finished

    def add(self, route: Route) -> None:
        self.open[route.request_id] = route

    def close(self, request_id: str) -> None:
        if self.open.pop(request_id, None) is not None:
            self._finished[request_id] = None
            while len(self._finished) > FINISHED_IDS_KEPT:
                self._finished.popitem(last=False)

    def of_conn(self, conn_id: str) -> list[Route]:
        return [r for r in self.open.values() if conn_id in (r.drafter, r.owner)]

    def of_origin(self, origin: str) -> list[Route]:
        """The open requests a coordinator sent (whose clients it relays to)."""
        return [r for r in self.open.values() if r.origin == origin]
