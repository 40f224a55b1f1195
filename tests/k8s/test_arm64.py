"""The Jetson drafter's image built for linux/arm64 under qemu-user-static, then run once: it must
load the draft model and decode exactly the tokens the same model decodes on this host.

Slow tier (a few minutes: an arm64 debootstrap and the arm64 torch wheel installed under
emulation): `pytest -m slow tests/k8s/test_arm64.py`.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from shared.models import load_model
from tests.conftest import greedy_reference
from tests.k8s.manifests import ROOT, runner

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPT = "def parse("
SMOKE = f"""
import json, platform, torch
from shared.models import load_model
m = load_model("/opt/specfleet/models/draft-small")
ids = list(m.tokenizer({PROMPT!r})["input_ids"])
out = []
for _ in range(8):
    t = int(m.model(torch.tensor([ids])).logits[0, -1].argmax())
    out.append(t)
    ids.append(t)
print(json.dumps({{"machine": platform.machine(), "torch": torch.__version__, "tokens": out}}))
"""


def test_arm64_drafter_image_builds_and_decodes() -> None:
    play = runner()
    try:
        image = play.build_arm64()
    except play.PlayError as exc:
        pytest.fail(f"arm64 build failed: {exc}")
    inspect = json.loads(play.run(["podman", "image", "inspect", image]))[0]
    assert inspect["Architecture"] == "arm64"
    assert inspect["Config"]["User"].split(":")[0] == "10001"
    helptext = play.run(["podman", "run", "--rm", "--platform", "linux/arm64", image, "--help"])
    assert "verifier-url" in helptext and "SPECFLEET_" in helptext
    proc = subprocess.run(["podman", "run", "--rm", "--platform", "linux/arm64", "--entrypoint", "python3", image,
                           "-c", SMOKE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["machine"] == "aarch64" and result["torch"].startswith("2.13.0")
    host = load_model(ROOT / "models" / "draft-small")
    ref = greedy_reference(host.model, list(host.tokenizer(PROMPT)["input_ids"]), 8, set())
    assert result["tokens"] == ref, "the arm64 image decodes differently from this host"
