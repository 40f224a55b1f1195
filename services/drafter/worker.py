"""The one place that runs the draft model.

Every proposer call goes through a single-thread executor: the model never runs two forward
passes at once, calls run in submission order (so a session's ``commit`` always lands before
its next ``propose``), and the event loop stays free for network traffic meanwhile. A private
executor rather than ``asyncio.to_thread`` plus a lock: when a session task is cancelled while
its draft is computing, an asyncio lock would be released early and let a second forward pass
start beside the first; the executor simply runs the next job after the current one ends.

``inline=True`` runs every call on the event loop itself instead (``--compute-mode inline``):
with a single CPU there is nothing for the network to overlap with, and the two thread
hand-overs per round only add latency. Order and exclusivity hold trivially.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from shared.log import get_logger

T = TypeVar("T")
log = get_logger("drafter.worker")


class ComputeWorker:
    def __init__(self, name: str = "draft-compute", inline: bool = False) -> None:
        self.inline = inline
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the worker thread (or inline) and await its result."""
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` without waiting (bookkeeping such as commit/close); errors are logged.

        After shutdown this is a no-op: the proposer's state is being discarded anyway.
        """
        if self.inline:
            try:
                fn(*args)
            except Exception as exc:
                log.error("draft worker job failed", error=repr(exc))
            return
        try:
            fut = self._pool.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            return
        fut.add_done_callback(_log_failure)

    def shutdown(self) -> None:
        """Let the running job finish, drop queued ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _log_failure(fut: Future[Any]) -> None:
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.error("draft worker job failed", error=repr(exc))
