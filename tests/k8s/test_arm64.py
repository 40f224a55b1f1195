"""The Jetson drafter's image built for linux/arm64 under qemu-user-static, then run under emulation.

Slow tier (an arm64 debootstrap and the arm64 torch wheel installed under emulation: about half an
hour on this 2-core machine): `pytest -m slow tests/k8s/test_arm64.py`.

What runs under emulation: the arm64 Python, specfleet's packages and configuration, the wheels'
native code (tokenizers, msgspec), the draft model's tokenizer (checked against this host's
tokenization). What does not: importing torch. With qemu-user 7.2, torch 2.13's aarch64 build
crashes at import in oneDNN's CPU detection (it reads MIDR_EL1 from sysfs, which qemu-user does
not provide, then segfaults), so the model itself is only run on real arm64 hardware.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from tokenizers import Tokenizer

from tests.k8s.manifests import ROOT, runner

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPT = "def parse(self, text):\n    return"
SMOKE = f"""
import json, platform
from importlib.metadata import version
import msgspec
from tokenizers import Tokenizer
from services.drafter.config import DrafterConfig
from shared.config import load_config
from shared.protocol import Hello, encode, decode
cfg = load_config(DrafterConfig, [])
tok = Tokenizer.from_file(cfg.draft_model.model + "/tokenizer.json")
hello = decode(encode(Hello(role="drafter", node_id="arm64", protocol_version=1, tokenizer_fingerprint="x",
                            model="draft", max_sessions=1)))
print(json.dumps({{"machine": platform.machine(), "torch": version("torch"), "model": cfg.draft_model.model,
                  "device": cfg.draft_model.device, "metrics_port": cfg.node.metrics_port, "hello": hello.node_id,
                  "ids": tok.encode({PROMPT!r}).ids}}))
"""


def test_arm64_drafter_image_builds_and_runs() -> None:
    play = runner()
    try:
        image = play.build_arm64()
    except play.PlayError as exc:
        pytest.fail(f"arm64 build failed: {exc}")
    inspect = json.loads(play.run(["podman", "image", "inspect", image]))[0]
    assert inspect["Architecture"] == "arm64"
    assert inspect["Config"]["User"].split(":")[0] == "10001"
    assert "9100/tcp" in inspect["Config"]["ExposedPorts"] and "/health" in " ".join(inspect["Healthcheck"]["Test"])
    proc = subprocess.run(["podman", "run", "--rm", "--platform", "linux/arm64", "--entrypoint", "python3", image,
                           "-c", SMOKE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["machine"] == "aarch64" and result["torch"].startswith("2.13.0")
    assert result["model"] == "/opt/specfleet/models/draft-small" and result["device"] == "cuda"
    assert result["metrics_port"] == 9100 and result["hello"] == "arm64"
    host = Tokenizer.from_file(str(ROOT / "models" / "draft-small" / "tokenizer.json"))
    assert result["ids"] == host.encode(PROMPT).ids and len(result["ids"]) > 3
