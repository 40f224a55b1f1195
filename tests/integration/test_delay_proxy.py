"""The benchmark's delay proxy on loopback: delay per direction, order under jitter, disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from bench.delay_proxy import DelayProxy, Link


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest_asyncio.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()


async def proxied(link: Link, port: int) -> tuple[DelayProxy, asyncio.StreamReader, asyncio.StreamWriter]:
    proxy = DelayProxy(link, ("127.0.0.1", port))
    listen = await proxy.start("127.0.0.1")
    reader, writer = await asyncio.open_connection("127.0.0.1", listen)
    return proxy, reader, writer


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> float:
    started = time.monotonic()
    writer.write(data)
    await writer.drain()
    assert await reader.readexactly(len(data)) == data
    return time.monotonic() - started


@pytest.mark.asyncio
@pytest.mark.parametrize("delay_ms", [0.0, 20.0])
async def test_a_round_trip_costs_twice_the_one_way_delay(delay_ms: float, echo_port: int) -> None:
    proxy, reader, writer = await proxied(Link(delay_ms=delay_ms), echo_port)
    try:
        rtts = [await round_trip(reader, writer, b"ping") for _ in range(5)]
    finally:
        writer.close()
        await proxy.close()
    assert min(rtts) >= 2 * delay_ms / 1000
    assert sorted(rtts)[2] < 2 * delay_ms / 1000 + 0.5  # generous: the machine is shared


@pytest.mark.asyncio
async def test_jitter_never_reorders_a_stream(echo_port: int) -> None:
    proxy, reader, writer = await proxied(Link(delay_ms=1.0, jitter_ms=5.0, seed=1), echo_port)
    sent = b"".join(f"{i:06d}".encode() for i in range(2000))
    try:
        for i in range(0, len(sent), 600):  # many small writes, each with its own jitter
            writer.write(sent[i:i + 600])
            await writer.drain()
            await asyncio.sleep(0)
        got = await asyncio.wait_for(reader.readexactly(len(sent)), 10)
    finally:
        writer.close()
        await proxy.close()
    assert got == sent


@pytest.mark.asyncio
async def test_a_link_that_drops_closes_the_connection(echo_port: int) -> None:
    proxy, reader, writer = await proxied(Link(disconnect_after_s=0.2), echo_port)
    try:
        await round_trip(reader, writer, b"before")
        assert await asyncio.wait_for(reader.read(10), 5) == b""  # EOF: the link dropped
    finally:
        writer.close()
        await proxy.close()


@pytest.mark.asyncio
async def test_drop_closes_the_open_connections_and_accepts_new_ones(echo_port: int) -> None:
    proxy = DelayProxy(Link(), ("127.0.0.1", echo_port))
    port = await proxy.start("127.0.0.1")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await round_trip(reader, writer, b"before")
        proxy.drop()
        assert await asyncio.wait_for(reader.read(10), 5) == b""  # EOF: the link dropped
        again, rewriter = await asyncio.open_connection("127.0.0.1", port)
        await round_trip(again, rewriter, b"after")
        rewriter.close()
        assert proxy.connections == 2
    finally:
        writer.close()
        await proxy.close()


@pytest.mark.asyncio
async def test_a_partition_refuses_new_connections(echo_port: int) -> None:
    proxy = DelayProxy(Link(), ("127.0.0.1", echo_port))
    port = await proxy.start("127.0.0.1")
    proxy.refuse = True
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await asyncio.wait_for(reader.read(10), 5) == b""
    finally:
        writer.close()
        await proxy.close()


@pytest.mark.asyncio
async def test_a_partition_holds_traffic_until_it_heals(echo_port: int) -> None:
    proxy, reader, writer = await proxied(Link(), echo_port)
    try:
        await round_trip(reader, writer, b"before")
        proxy.partition()
        writer.write(b"during")
        await writer.drain()
        with pytest.raises(TimeoutError):  # nothing crosses while the link is cut
            await asyncio.wait_for(reader.read(10), 0.5)
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(6), 5) == b"during"  # held, then delivered in order
    finally:
        writer.close()
        await proxy.close()


def test_negative_delays_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Link(delay_ms=-1)
