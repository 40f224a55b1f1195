"""Where a client stands in a resumable stream: its event ids, and what a resume skips.

Every chunk of a streamed response has a *position* in its choice's stream, fixed by the
verifier's numbering of the request's TokenEvents (``TokenEvent.seq``, 1, 2, ...), so that any
coordinator replaying the same events puts every chunk at the same position:

=========================  ===========================================================
position                   chunk
=========================  ===========================================================
0                          the chat role chunk (``delta.role``)
1                          the ``echo`` text
2·seq                      the text (and logprobs) of event ``seq``
2·seq + 1                  the finish chunk (``finish_reason``) of the final event
2·seq + 2 (choice 0)       the usage chunk, after every choice's final event
=========================  ===========================================================

An SSE event id is ``<request id>.<p0>[.<p1>...]``: the position of the last chunk sent of each
choice (-1: none yet). A client that reconnects with it as ``Last-Event-ID`` gets every chunk
past those positions, and no other. The WebSocket's frames carry the position as ``index``.
"""

from __future__ import annotations

import re

ROLE, ECHO = 0, 1
NONE_YET = -1
_ID = re.compile(r"(?:chatcmpl-|cmpl-)?([0-9a-f]{32})((?:\.-?\d{1,12}){1,128})")  # a position per choice


class BadEventId(ValueError):
    """A Last-Event-ID (or a resume frame's index) that no stream of this fleet ever sent."""


def text_pos(seq: int) -> int:
    return 2 * seq


def finish_pos(seq: int) -> int:
    return 2 * seq + 1


def usage_pos(seq: int) -> int:
    return 2 * seq + 2


def event_id(request_id: str, positions: list[int]) -> str:
    return request_id + "".join(f".{p}" for p in positions)


def parse_event_id(value: str) -> tuple[str, list[int]]:
    """The request id and per-choice positions of a ``Last-Event-ID``; BadEventId says why not."""
    match = _ID.fullmatch(value.strip())
    if match is None:
        raise BadEventId(f"Last-Event-ID {value[:80]!r} is not an event id of this service: send the id: "
                         "line of the last event received, e.g. '3f2a...9c.14'")
    positions = [int(p) for p in match.group(2).split(".")[1:]]
    if min(positions) < NONE_YET:
        raise BadEventId(f"Last-Event-ID {value[:80]!r} has a negative position")
    return match.group(1), positions


def last_position(state: str, last_seq: int, choice: int) -> int:
    """The furthest position a client can have received of a choice whose events so far end at
    ``last_seq`` (``state``: the verifier's Adopted.state)."""
    if state == "finished" and last_seq:
        return usage_pos(last_seq) if choice == 0 else finish_pos(last_seq)
    return text_pos(last_seq) if last_seq else ECHO
