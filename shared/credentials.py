"""Who may connect: the shared bearer token, or per-drafter credentials from a file re-read on change.

Two modes, chosen by the services' ``--credentials-file``:

* **shared token** (no file; the simple default): every peer presents ``--auth-token``; an empty
  token switches auth off (loopback only). Drafters name themselves in their Hello.
* **per-drafter credentials**: a JSON file lists each drafter's identity, token and trust::

      {"drafters": [
        {"id": "jetson-7", "token_sha256": "<hex sha256 of its token>", "trusted": false},
        {"id": "lab-box", "token": "<the token itself>", "trusted": true}
      ]}

  A drafter presents its own token; its Hello must carry the identity the token belongs to
  (``--node-id``). The shared ``--auth-token`` no longer admits drafters; it stays the
  coordinator's (frontend's) credential. ``token_sha256`` keeps the file free of usable
  secrets (``printf %s "$TOKEN" | sha256sum``). ``trusted`` (default false) decides whether the
  verifier believes the drafter's q (see ``services/verifier/intake.py``).

Revocation without a restart: edit the file (remove the entry or change its token). Services
stat it at most every ``RECHECK_S`` seconds and re-read it when it changed; connections whose
credential is gone are closed, and new ones are refused. A file that no longer parses is
reported and ignored: the last good version stays in force.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from shared.log import get_logger

log = get_logger("credentials")
RECHECK_S = 0.5


class CredentialsError(ValueError):
    """The credentials file is missing or malformed; the message says what to fix."""


@dataclass(frozen=True)
class Identity:
    """An authenticated peer. ``name`` is None in shared-token mode (the Hello names the peer);
    ``trusted`` is None when the credential does not say (the service's default applies)."""

    name: str | None
    trusted: bool | None = None
    token_sha256: str = ""


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header ('' when absent or malformed)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def parse_file(text: str, where: str) -> dict[str, Identity]:
    """token sha256 -> Identity, from the file's JSON text."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CredentialsError(f"{where} is not valid JSON: {exc}") from None
    entries = data.get("drafters") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise CredentialsError(f'{where} must be an object with a "drafters" list')
    out: dict[str, Identity] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise CredentialsError(f'{where}: drafters[{i}] needs a non-empty string "id"')
        digest = entry.get("token_sha256") or (sha256_hex(entry["token"]) if isinstance(entry.get("token"), str)
                                               and entry["token"] else "")
        if not isinstance(digest, str) or len(digest) != 64:
            raise CredentialsError(f'{where}: drafters[{i}] ({entry["id"]}) needs "token" or a 64-hex "token_sha256"')
        trusted = entry.get("trusted", False)
        if not isinstance(trusted, bool):
            raise CredentialsError(f'{where}: drafters[{i}] ({entry["id"]}): "trusted" must be true or false')
        digest = digest.lower()
        if digest in out:
            raise CredentialsError(f"{where}: drafters {out[digest].name} and {entry['id']} share a token")
        out[digest] = Identity(entry["id"], trusted, digest)
    return out


class Credentials:
    """Authenticates peers in either mode; ``path`` empty means shared-token mode."""

    def __init__(self, shared_token: str = "", path: str = "") -> None:
        self.shared_token = shared_token
        self.path = path
        self._by_digest: dict[str, Identity] = {}
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self.generation = 0  # bumped on every successful reload
        if path:
            if not Path(path).is_file():
                raise CredentialsError(f"--credentials-file {path!r} does not exist")
            self._by_digest = parse_file(Path(path).read_text(), path)
            self._stamp = _stamp(path)
            self._checked = time.monotonic()

    @property
    def per_drafter(self) -> bool:
        return bool(self.path)

    @property
    def enabled(self) -> bool:
        return bool(self.shared_token or self.path)

    def refresh(self, force: bool = False) -> bool:
        """Re-read the file if it changed (stat at most every RECHECK_S); True when it was reloaded."""
        if not self.path:
            return False
        now = time.monotonic()
        if not force and now - self._checked < RECHECK_S:
            return False
        self._checked = now
        try:
            stamp = _stamp(self.path)
        except OSError as exc:
            log.error("credentials file unreadable; keeping the last good version", path=self.path, error=str(exc))
            return False
        if stamp == self._stamp:
            return False
        try:
            table = parse_file(Path(self.path).read_text(), self.path)
        except (OSError, CredentialsError) as exc:
            log.error("credentials file rejected; keeping the last good version", path=self.path, error=str(exc))
            return False
        self._by_digest, self._stamp = table, stamp
        self.generation += 1
        log.info("credentials reloaded", path=self.path, drafters=len(table))
        return True

    def authenticate(self, authorization: str | None, role: str) -> Identity | None:
        """The peer's identity, or None when its credential is missing, wrong or revoked."""
        token = bearer(authorization)
        shared_ok = bool(self.shared_token) and hmac.compare_digest(token.encode(), self.shared_token.encode())
        if role != "drafter" or not self.path:
            if not self.enabled:
                return Identity(None)
            return Identity(None) if shared_ok else None
        self.refresh()
        if not token:
            return None
        return self._by_digest.get(sha256_hex(token))

    def still_valid(self, identity: Identity) -> bool:
        """False once the file no longer holds ``identity``'s credential (revoked or rotated)."""
        if identity.name is None:
            return True
        self.refresh()
        return self._by_digest.get(identity.token_sha256) == identity

    def refusal(self, authorization: str | None, role: str) -> str:
        """What to tell a peer that ``authenticate`` refused (never echoes the token)."""
        if role == "drafter" and self.path:
            if not bearer(authorization):
                return ("this service uses per-drafter credentials: send 'Authorization: Bearer <your drafter "
                        "token>' (drafter --auth-token)")
            return "unknown or revoked drafter token: ask the operator for this drafter's credential"
        return ("missing or wrong bearer token: set auth_token (--auth-token, SPECFLEET_AUTH_TOKEN) to the "
                "fleet's shared token")


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def check_hello_identity(identity: Identity, node_id: str) -> str:
    """A problem when a per-drafter credential is used under another drafter's name, else ''."""
    if identity.name is not None and node_id != identity.name:
        return (f"this token belongs to drafter {identity.name!r} but the Hello names {node_id!r}: start the "
                f"drafter with --node-id {identity.name}")
    return ""
