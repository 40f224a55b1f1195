"""A TCP delay proxy: network latency, jitter and disconnects where the kernel has no netem.

    proxy = DelayProxy(Link(delay_ms=20, jitter_ms=2), target=("127.0.0.1", 8100))
    port = await proxy.start("10.77.0.1", 0)      # clients connect here instead of the target

Every chunk read from one side is forwarded to the other after the direction's delay (so a
round trip through the proxy costs ``2 × delay_ms`` more than without it), plus a uniform
jitter in [0, jitter_ms]. Chunks of one direction never overtake each other, as on one TCP
connection. ``disconnect_after_s`` closes each connection that long after it opened (a link
that drops); ``refuse`` makes the proxy reset new connections, and :meth:`DelayProxy.partition`
cuts the link both ways until :meth:`DelayProxy.heal`: open connections stay open but nothing
crosses (as when a route goes away under TCP; what was sent meanwhile arrives after the heal, in
order) and new connections are refused. Bandwidth is shaped separately, by ``tc`` on the
namespaces' veth devices (``bench.netns``).

Run it alone: ``python -m bench.delay_proxy --listen 127.0.0.1:9100 --target 127.0.0.1:8100
--delay-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

CHUNK = 65536


@dataclass
class Link:
    """One direction's (or both directions') impairments."""

    delay_ms: float = 0.0  # one-way
    jitter_ms: float = 0.0  # uniform extra delay in [0, jitter_ms]
    disconnect_after_s: float = 0.0  # 0: never
    seed: int | None = None
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.disconnect_after_s < 0:
            raise ValueError("delay, jitter and disconnect time must be >= 0")
        self.rng = random.Random(self.seed)

    def one_way_s(self) -> float:
        return (self.delay_ms + (self.rng.uniform(0.0, self.jitter_ms) if self.jitter_ms else 0.0)) / 1000


class DelayProxy:
    def __init__(self, link: Link, target: tuple[str, int]) -> None:
        self.link = link
        self.target = target
        self.refuse = False  # new connections are closed at once
        self.connections = 0
        self._healed = asyncio.Event()  # cleared during a partition: nothing is forwarded
        self._healed.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    def partition(self) -> None:
        """Cut the link: hold every byte in both directions and refuse new connections."""
        self.refuse = True
        self._healed.clear()

    def heal(self) -> None:
        """Restore the link: what was held flows on, in order."""
        self.refuse = False
        self._healed.set()

    def drop(self) -> None:
        """Drop every open connection now, as a link that fails once (new connections are accepted)."""
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._pump_both(reader, writer, up_reader, up_writer)
        finally:
            self._tasks.discard(task)
            for w in (writer, up_writer):
                w.close()

    async def _pump_both(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
        pumps = [asyncio.create_task(self._pump(reader, up_writer)), asyncio.create_task(self._pump(up_reader, writer))]
        if self.link.disconnect_after_s:
            pumps.append(asyncio.create_task(asyncio.sleep(self.link.disconnect_after_s)))
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction: each chunk leaves ``one_way_s`` after it arrived, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        try:
            last_due = 0.0
            while data := await reader.read(CHUNK):
                last_due = max(last_due, time.monotonic() + self.link.one_way_s())
                queue.put_nowait((last_due, data))
            queue.put_nowait((last_due, b""))  # EOF, delayed like the data before it
            await sender
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._healed.wait()
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _serve(args: argparse.Namespace) -> None:
    proxy = DelayProxy(Link(args.delay_ms, args.jitter_ms, args.disconnect_after_s), _addr(args.target))
    host, port = _addr(args.listen)
    bound = await proxy.start(host, port)
    print(f"delay proxy {host}:{bound} -> {args.target}, one-way {args.delay_ms} ms (+0..{args.jitter_ms} ms)",
          flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delay_proxy", description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any)")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--disconnect-after-s", type=float, default=0.0)
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
