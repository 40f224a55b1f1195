"""TLS settings: contexts from test-made files, pinning, plaintext refused under --require-tls,
clear errors naming the flag, and a wss:// handshake that only the pinned CA passes."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
import websockets
from websockets.asyncio.server import ServerConnection, serve

from services.drafter.config import DrafterConfig
from services.drafter.main import link_tls
from shared.config import ConfigError, flat, from_flags
from shared.tls import TlsConfigError, client_context, server_context
from tests.security.certs import make_tls


def test_server_context_needs_both_files_and_names_the_flag(tmp_path: Path) -> None:
    files = make_tls(tmp_path)
    assert server_context("", "") is None
    assert isinstance(server_context(str(files.cert), str(files.key)), ssl.SSLContext)
    with pytest.raises(TlsConfigError, match="go together"):
        server_context(str(files.cert), "")
    with pytest.raises(TlsConfigError, match="--tls-key"):
        server_context(str(files.cert), str(tmp_path / "missing.key"))
    with pytest.raises(TlsConfigError, match="cannot load --tls-cert"):
        server_context(str(files.key), str(files.key))


def test_client_context_pins_and_refuses_plaintext(tmp_path: Path) -> None:
    files = make_tls(tmp_path)
    assert client_context("ws://h:1/v1/drafter") is None
    with pytest.raises(TlsConfigError, match="--require-tls"):
        client_context("ws://h:1/v1/drafter", require_tls=True)
    ctx = client_context("wss://h:1/v1/drafter", str(files.ca), require_tls=True)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1  # only the pinned CA, not the system store
    with pytest.raises(TlsConfigError, match="--tls-ca"):
        client_context("wss://h:1/", str(tmp_path / "nope.pem"))


def test_drafter_require_tls_refuses_plaintext_urls(tmp_path: Path) -> None:
    files = make_tls(tmp_path)
    secure = from_flags(DrafterConfig, verifier_url="wss://v:8100/v1/drafter", queue_url="wss://c:8000/internal/queue",
                           tls_ca=str(files.ca), require_tls=True)
    verifier, queue = link_tls(secure)
    assert verifier is not None and queue is not None
    for field, url in (("verifier_url", "ws://v:8100/v1/drafter"), ("queue_url", "ws://c:8000/internal/queue"),
                       ("queue_url", "redis://r:6379/0")):
        cfg = from_flags(DrafterConfig, **{**flat(secure), field: url})
        with pytest.raises(ConfigError, match="require-tls"):
            link_tls(cfg)


@pytest.mark.asyncio
async def test_wss_handshake_passes_only_with_the_pinned_ca(tmp_path: Path) -> None:
    files, other = make_tls(tmp_path / "a"), make_tls(tmp_path / "b", ca_name="another CA")

    async def echo(ws: ServerConnection) -> None:
        async for msg in ws:
            await ws.send(msg)

    tls = server_context(str(files.cert), str(files.key))
    async with serve(echo, "127.0.0.1", 0, ssl=tls) as server:
        port = server.sockets[0].getsockname()[1] if server.sockets else 0
        url = f"wss://127.0.0.1:{port}/"
        async with websockets.connect(url, ssl=client_context(url, str(files.ca))) as ws:
            await ws.send(b"ping")
            assert await asyncio.wait_for(ws.recv(), 5) == b"ping"
        with pytest.raises(ssl.SSLCertVerificationError):
            async with websockets.connect(url, ssl=client_context(url, str(other.ca))):
                pass
        with pytest.raises((ConnectionError, websockets.InvalidMessage, websockets.InvalidHandshake, OSError)):
            async with websockets.connect(f"ws://127.0.0.1:{port}/", open_timeout=5):
                pass
