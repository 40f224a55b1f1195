"""The benchmark's emulated edge network: a namespace, a shaped veth pair and delay proxies."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from bench.netns import edge_network, remove_stale, why_no_netns

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


def test_each_service_can_have_an_rtt_of_its_own(echo_port: int) -> None:
    targets = {"near": echo_port, "far": echo_port}
    with edge_network(rtt_ms=0, rate_mbit=0, targets=targets, use_netns=False, rtts={"far": 60}) as net:
        near, far = edge_rtt(net.prefix, net.addr["near"]), edge_rtt(net.prefix, net.addr["far"])
        assert far >= 0.060 > near
        assert "far +60 ms" in net.describe()


def test_namespaces_left_by_dead_runs_are_removed_before_a_new_one() -> None:
    if why_no_netns():
        pytest.skip(f"network namespaces unavailable here: {why_no_netns()}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"sf-edge-{dead.pid}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in remove_stale()
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
