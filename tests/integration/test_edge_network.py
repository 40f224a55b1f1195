"""The benchmark's emulated edge network: a namespace, a shaped veth pair and delay proxies."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from bench.netns import edge_network, why_no_netns

CLIENT = """
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=10)
rtts = []
for _ in range(5):
    t = time.monotonic(); s.sendall(b"ping"); assert s.recv(4) == b"ping"; rtts.append(time.monotonic() - t)
print(min(rtts))
"""


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A loopback echo server on a thread of its own (the edge client runs in another process)."""
    loop = asyncio.new_event_loop()
    ready: list[int] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def serve() -> asyncio.Server:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        ready.append(int(server.sockets[0].getsockname()[1]))
        return server

    server = loop.run_until_complete(serve())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield ready[0]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    server.close()
    loop.run_until_complete(server.wait_closed())
    loop.close()


def edge_rtt(prefix: list[str], addr: str) -> float:
    out = subprocess.run([*prefix, sys.executable, "-c", CLIENT, addr], capture_output=True, text=True, timeout=60,
                         check=True)
    return float(out.stdout.strip())


@pytest.mark.parametrize("use_netns", [True, False], ids=["netns", "loopback"])
def test_the_edge_reaches_the_server_only_through_the_delay(use_netns: bool, echo_port: int) -> None:
    if use_netns and why_no_netns():
        pytest.skip(f"network namespaces unavailable here: {why_no_netns()}")
    with edge_network(rtt_ms=30, rate_mbit=10, targets={"echo": echo_port}, use_netns=use_netns) as net:
        assert net.mode == "netns" if use_netns else net.mode.startswith("loopback")
        assert edge_rtt(net.prefix, net.addr["echo"]) >= 0.030
        if use_netns:  # the server's loopback is not reachable from the edge namespace
            direct = subprocess.run([*net.prefix, sys.executable, "-c", CLIENT, f"127.0.0.1:{echo_port}"],
                                    capture_output=True, text=True, timeout=60, check=False)
            assert direct.returncode != 0
    if use_netns:  # and everything is gone afterwards
        assert net.prefix[-1] not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
