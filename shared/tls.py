"""TLS for every link between specfleet services: server contexts and CA-pinned client contexts.

Servers (the verifier; the coordinator, whose port also serves the drafters' queue link) take a
certificate chain and its private key (``--tls-cert``, ``--tls-key``). Clients (drafters, the
coordinator's verifier link) connect to ``wss://`` URLs; with ``--tls-ca FILE`` they trust only
the certificate authorities in that file (pinning: the system store is not consulted), else the
system's store. Hostnames are always checked, so a certificate must name the host (a DNS name or
an IP address in its subjectAltName) that the URL uses.

``require_tls`` (drafter ``--require-tls``) refuses any ``ws://`` URL, so a drafter on a public
network cannot fall back to plaintext by a configuration mistake.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any


class TlsConfigError(ValueError):
    """A certificate, key or CA file is missing or unusable; the message names the flag."""


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """A server context for ``--tls-cert``/``--tls-key``, or None when neither is set (plaintext)."""
    if not cert_file and not key_file:
        return None
    if not cert_file or not key_file:
        raise TlsConfigError("--tls-cert and --tls-key go together: give both (PEM certificate chain and its key) "
                             "or neither")
    for flag, path in (("--tls-cert", cert_file), ("--tls-key", key_file)):
        if not Path(path).is_file():
            raise TlsConfigError(f"{flag} {path!r} is not a readable file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"cannot load --tls-cert {cert_file!r} with --tls-key {key_file!r}: {exc}") from None
    return ctx


def client_context(url: str, ca_file: str = "", require_tls: bool = False) -> ssl.SSLContext | None:
    """The context to open ``url`` with: None for ``ws://`` (unless ``require_tls`` refuses it),
    for ``wss://`` one that trusts only ``ca_file`` when given (else the system's CAs)."""
    scheme = url.partition("://")[0].lower()
    if scheme in ("ws", "http"):
        if require_tls:
            raise TlsConfigError(f"{url!r} is plaintext but --require-tls is set: use a wss:// URL "
                                 "(and --tls-ca to pin the server's certificate authority)")
        return None
    if ca_file and not Path(ca_file).is_file():
        raise TlsConfigError(f"--tls-ca {ca_file!r} is not a readable file")
    try:
        ctx = ssl.create_default_context(cafile=ca_file or None)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"cannot load --tls-ca {ca_file!r}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def ssl_kwargs(ctx: ssl.SSLContext | None) -> dict[str, Any]:
    """``websockets.connect`` keyword arguments for ``ctx`` (none at all for None: websockets
    refuses ``ssl=None`` on wss:// and any ``ssl`` on ws://)."""
    return {"ssl": ctx} if ctx is not None else {}
