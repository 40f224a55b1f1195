"""Yielding to the event loop after blocking work, long enough for the frames that arrived meanwhile.

A service that computes on its event loop (the verifier's inline core, the drafter's inline
compute) blocks the loop for a whole forward. Frames that arrive meanwhile wait in the socket.
One ``await asyncio.sleep(0)`` is not enough to see them: a message that arrived during the
blocking work is handled only on the third pass of the loop after it.

1. The loop's next pass polls the sockets, but the task that yielded is already in the queue
   of ready callbacks, ahead of the read callbacks that poll adds, so it runs again first.
2. The read callback (``data_received``) parses the frame and wakes the connection's reader task.
3. The reader task runs and hands the message on (the verifier's ``core.submit``, the
   drafter's verdict to its session).

This is how websockets 17.4 and asyncio's selector loop behave (read, not assumed);
``tests/unit/test_event_loop.py`` measures it with a real websocket and fails if one pass fewer
would do, or if these are not enough. Without these passes, a
saturated verifier steps again with the drafts it already had, and those that arrived during the
last step wait one more step: their sessions fall out of step with the rest and the steps stay
small. Each pass costs a few microseconds when nothing is pending.
"""

from __future__ import annotations

import asyncio

#: passes of the event loop until a message that arrived during blocking work has been handled
IO_HOPS = 3


async def let_io_in(handoffs: int = 0) -> None:
    """Yield until frames that arrived during blocking work are read and handed on: by the reader
    task itself, plus ``handoffs`` further tasks (one more pass each; the drafter's reader puts a
    verdict in its session's inbox, and the session task then asks the batcher for a draft, at
    once unless it first waits for a lookahead to settle: such a session joins the next batch)."""
    for _ in range(IO_HOPS + handoffs):
        await asyncio.sleep(0)
