"""``shared.event_loop.let_io_in``: after blocking work on the event loop, a websocket message
that arrived meanwhile has been handed on; with one pass fewer it has not (so IO_HOPS is the
least that works, and what the verifier's inline core and the drafter's batcher rely on)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from shared.event_loop import IO_HOPS, let_io_in

WAIT_S = 10.0  # the most the test waits for the peer (a loaded machine may be slow to schedule it)


@contextmanager
def peer_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The sending side runs on a loop of its own, in a thread, as another process would."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@asynccontextmanager
async def linked(got: list[str], loop: asyncio.AbstractEventLoop) -> AsyncIterator[ClientConnection]:
    async def handler(ws: ServerConnection) -> None:
        async for msg in ws:
            got.append(str(msg))

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]

        async def dial() -> ClientConnection:
            return await connect(f"ws://127.0.0.1:{port}")

        client = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(dial(), loop))
        try:
            yield client
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.close(), loop))


async def send_and_tell(client: ClientConnection, sent: threading.Event) -> None:
    await client.send("draft")  # on loopback the bytes are in the server's socket once this returns
    sent.set()


async def handled_after(passes: int) -> bool:
    """Block the loop while the peer sends; then yield ``passes`` times: was the message handled?"""
    got: list[str] = []
    with peer_loop() as loop:
        async with linked(got, loop) as client:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.send("warm-up"), loop))
            async with asyncio.timeout(WAIT_S):
                while not got:
                    await asyncio.sleep(0.001)
            got.clear()
            sent = threading.Event()
            asyncio.run_coroutine_threadsafe(send_and_tell(client, sent), loop)
            assert sent.wait(WAIT_S), "the peer did not send"  # blocks the event loop, as an inline forward does
            time.sleep(0.005)  # and a little longer, as a forward ends after the frame came in
            if passes == IO_HOPS:
                await let_io_in()
            else:
                for _ in range(passes):
                    await asyncio.sleep(0)
            return got == ["draft"]


@pytest.mark.asyncio
async def test_a_message_that_arrived_during_blocking_work_is_handled_after_let_io_in() -> None:
    assert await handled_after(IO_HOPS)


@pytest.mark.asyncio
async def test_one_pass_fewer_is_not_enough() -> None:
    assert not await handled_after(IO_HOPS - 1)
