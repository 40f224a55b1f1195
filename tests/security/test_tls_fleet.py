"""The fleet as real processes with TLS on every link and per-drafter credentials.

One fleet (verifier, coordinator, one drafter) is started with a certificate this test makes
itself: the verifier and the coordinator serve wss:// / https://, the coordinator's verifier
link and the drafter pin the test CA, the drafter refuses plaintext, and the drafter holds its
own token from a credentials file (untrusted). Then:

* greedy output over HTTPS and over wss:// ``/v1/stream`` is token-identical to the target alone;
* plaintext and an unpinned CA are refused;
* no log line and no ``/metrics`` output holds a token, the API key or the prompt text;
* removing the drafter's entry from the credentials file disconnects it without a restart.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from shared.fleet import Fleet, FleetSpec, running_fleet
from shared.models import LoadedModel, load_model
from tests.conftest import free_port, greedy_reference
from tests.security.certs import TlsFiles, make_tls

pytestmark = pytest.mark.e2e

SHARED_TOKEN = "shared-fleet-token-7Qw9"
DRAFTER_TOKEN = "drafter-one-token-Zx31"
API_KEY = "sk-client-key-Pk88"
PROMPT = "zebra quartz marmalade"  # the prompt text that must never reach a log or /metrics
SECRETS = (SHARED_TOKEN, DRAFTER_TOKEN, API_KEY, PROMPT)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def fleet(tiny_models: dict[str, Path], tls: TlsFiles,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Path, Path, int]]:
    state = tmp_path_factory.mktemp("tls-fleet")
    creds = state / "credentials.json"
    creds.write_text(json.dumps({"drafters": [{"id": "drafter-1", "token": DRAFTER_TOKEN, "trusted": False}]}))
    spec = FleetSpec(
        target=tiny_models["target"], drafts=[tiny_models["draft-L2"]], coordinator_port=free_port(),
        verifier_port=free_port(), tls_cert=str(tls.cert), tls_key=str(tls.key), tls_ca=str(tls.ca),
        verifier_flags=["--credentials-file", str(creds), "--draft-len", "4", "--log-level", "debug"],
        coordinator_flags=["--credentials-file", str(creds), "--api-key", API_KEY, "--log-level", "debug"],
        drafter_flags=["--draft-mode", "greedy", "--log-level", "debug"], drafter_metrics_ports=[free_port()],
        per_drafter_flags=[["--auth-token", DRAFTER_TOKEN]],
    )
    logs = state / "logs"
    with running_fleet(spec, logs, SHARED_TOKEN) as running:
        yield running, logs, creds, spec.drafter_metrics_ports[0]


@pytest.fixture(scope="module")
def target(tiny_models: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_models["target"])


def client_ssl(tls: TlsFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls.ca))


def test_tls_fleet_serves_exact_output_and_keeps_secrets(fleet: tuple[Fleet, Path, Path, int], tls: TlsFiles,
                                                          target: LoadedModel, tmp_path: Path) -> None:
    stack, logs, creds, drafter_metrics_port = fleet
    assert stack.base_url.startswith("https://") and stack.ws_url.startswith("wss://")
    ref = greedy_reference(target.model, list(target.tokenizer(PROMPT)["input_ids"]), 24, target.eos_ids)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(verify=client_ssl(tls), timeout=60) as http:
        ready = http.get(stack.base_url + "/ready").json()
        assert ready["drafters"] == ["drafter-1"], ready
        body = {"model": "target", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        out = http.post(stack.base_url + "/v1/completions", json=body, headers=headers)
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"] == target.tokenizer.decode(ref, skip_special_tokens=True)
        assert http.post(stack.base_url + "/v1/completions", json=body).status_code == 401
        metrics = [http.get(stack.base_url + "/metrics").text, http.get(stack.verifier_url + "/metrics").text]
    ids = asyncio.run(_stream(stack.ws_url, tls))
    assert ids == ref
    metrics.append(httpx.get(f"http://127.0.0.1:{drafter_metrics_port}/metrics").text)
    assert "specfleet_" in metrics[2]

    # plaintext, and a server certificate from a CA the client did not pin, are both refused
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.base_url.replace("https://", "http://") + "/health", timeout=5)
    other = make_tls(tmp_path / "other", ca_name="some other CA")
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(stack.base_url + "/health", verify=client_ssl(other), timeout=5)
    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(_stream(stack.ws_url, other))

    # secrets and prompt text never reach a log line or /metrics
    texts = {p.name: p.read_text() for p in logs.glob("*.log")}
    assert set(texts) >= {"verifier.log", "coordinator.log", "drafter-1.log"}
    connected = [json.loads(line) for line in texts["verifier.log"].splitlines() if '"peer connected"' in line]
    assert any(e["node_id"] == "drafter-1" and e["trusted"] is False for e in connected), connected
    scraped = [(f"{name} /metrics", text) for name, text in zip(("coordinator", "verifier", "drafter"), metrics,
                                                                  strict=True)]
    for name, text in [*texts.items(), *scraped]:
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} leaked into {name}"

    # revocation without a restart: the drafter's entry goes, its links close and it is refused
    creds.write_text(json.dumps({"drafters": []}))
    deadline = time.monotonic() + 20
    with httpx.Client(verify=client_ssl(tls), timeout=10) as http:
        while http.get(stack.base_url + "/ready").json()["drafters"]:
            assert time.monotonic() < deadline, "the revoked drafter is still connected"
            time.sleep(0.2)
    verifier_log = (logs / "verifier.log").read_text()
    assert "credential revoked; disconnecting the drafter" in verifier_log


async def _stream(ws_url: str, tls: TlsFiles) -> list[int]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with websockets.connect(ws_url, ssl=client_ssl(tls), additional_headers=headers) as ws:
        await ws.send(json.dumps({"kind": "completion", "model": "target", "prompt": PROMPT, "max_tokens": 24,
                                  "temperature": 0}))
        ids: list[int] = []
        while True:
            frame = json.loads(await ws.recv())
            if frame["type"] == "token":
                ids += frame["token_ids"]
            elif frame["type"] == "done":
                return ids
            else:
                raise AssertionError(f"unexpected frame {frame}")


def test_up_smoke_with_tls_on_every_link(tiny_models: dict[str, Path], tls: TlsFiles, tmp_path: Path) -> None:
    """``specfleet up --tls-cert/--tls-key/--tls-ca``: every link is wss:// and the smoke request passes."""
    argv = [sys.executable, "-m", "shared.cli", "up", "--port", "0", "--verifier-port", "0", "--drafters", "1",
            "--target", str(tiny_models["target"]), "--drafts", str(tiny_models["draft-L1"]),
            "--state-dir", str(tmp_path / "state"), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key),
            "--tls-ca", str(tls.ca), "--smoke"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "smoke: reply" in proc.stdout
    logs = tmp_path / "state" / "logs"
    assert '"tls": true' in (logs / "verifier.log").read_text()
    assert '"tls": true' in (logs / "coordinator.log").read_text()
    assert "wss://" in (logs / "drafter-1.log").read_text()
    half = subprocess.run([*argv[:-7], "--tls-cert", str(tls.cert)], capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "go together" in half.stderr
