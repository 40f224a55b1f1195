"""What the coordinator has relayed of each in-flight request, so a lost verifier loses nothing.

The verifier owns a request's committed tokens, but every committed token also passed through
this coordinator on its way to the client. The ledger keeps, per request still in flight, how it
was opened (prompt, sampling parameters, SLO class), the tokens relayed so far, how many
characters of their text went out (the verifier holds back the tail that may still become a stop
string), and the cumulative drafted/accepted counts. When the verifier link comes back to a
*new* verifier instance (it restarted, or another took its place), :meth:`ResumeLedger.reopen`
turns each entry into an ``OpenSession`` with ``resume`` set: the new verifier continues after
the relayed tokens, target-only until a drafter takes the request again from the queue, and the
client's stream goes on where it paused, with no token repeated or skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.protocol import OpenSession, ResumeState, TokenEvent

#: How long in-flight requests wait for the verifier link to come back before they fail (503).
RESUME_WAIT_S = 90.0


@dataclass
class Relayed:
    opened: OpenSession  # how the request was opened (target-only form: prompt, params, origin, SLO)
    generated: list[int] = field(default_factory=list)
    released_chars: int = 0
    drafted: int = 0
    accepted: int = 0
    taken_at: float = field(default_factory=time.monotonic)  # when this coordinator took the request
    last_seq: int = 0  # the TokenEvent.seq relayed last

    def reopen(self) -> OpenSession:
        state = ResumeState(generated_ids=list(self.generated), released_chars=self.released_chars,
                            drafted_tokens=self.drafted, accepted_tokens=self.accepted, next_seq=self.last_seq + 1)
        o = self.opened
        return OpenSession(request_id=o.request_id, prompt_ids=o.prompt_ids, params=o.params, origin=o.origin,
                           speculative=False, slo_tokens_per_s=o.slo_tokens_per_s, resume=state,
                           waited_s=max(0.0, time.monotonic() - self.taken_at))  # its SLO clock runs on


class ResumeLedger:
    """Requests in flight and what of each was relayed (event-loop only, no locking)."""

    def __init__(self) -> None:
        self._entries: dict[str, Relayed] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def track(self, opened: OpenSession) -> None:
        self._entries[opened.request_id] = Relayed(opened)

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def clear(self) -> None:
        self._entries.clear()

    def seen(self, event: TokenEvent) -> bool:
        """Whether ``event`` was relayed already (a verifier replays a request's events to the
        coordinator that adopts it, this one too after its link came back)."""
        entry = self._entries.get(event.request_id)
        return entry is not None and 0 < event.seq <= entry.last_seq

    def relayed(self, event: TokenEvent) -> None:
        """Account one TokenEvent handed to the request's subscriber; a final one ends the entry."""
        entry = self._entries.get(event.request_id)
        if entry is None:
            return
        if event.finished:
            del self._entries[event.request_id]
            return
        entry.last_seq = event.seq or entry.last_seq
        entry.generated.extend(event.token_ids)
        entry.released_chars += len(event.text)
        entry.drafted, entry.accepted = event.drafted_tokens, event.accepted_tokens

    def reopen(self, request_ids: list[str] | None = None) -> list[OpenSession]:
        """One resuming OpenSession per request in flight (or per one of ``request_ids``), oldest first."""
        return [entry.reopen() for entry in self._select(request_ids)]

    def opened(self, request_ids: list[str]) -> list[OpenSession]:
        """How each of ``request_ids`` still in flight was opened (target-only form), oldest first."""
        return [entry.opened for entry in self._select(request_ids)]

    def _select(self, request_ids: list[str] | None) -> list[Relayed]:
        wanted = None if request_ids is None else set(request_ids)
        return [entry for rid, entry in self._entries.items() if wanted is None or rid in wanted]
