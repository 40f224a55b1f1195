"""The operator's view against a running fleet: every metric the Grafana dashboard and the alerts
query is exported, and the dashboard works in a real browser (headless Chromium).

With traffic flowing, the page shows a row per drafter and its numbers move; with every drafter
gone it says so; with the verifier dead it says that too; its console stays free of errors
throughout. A screenshot of the live page is saved (the README's picture of the real default fleet
comes from ``python -m bench dashboard-picture``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.browser import Page, chromium_binary, open_page
from shared.fleet import Fleet
from tests.conftest import free_port
from tests.e2e.greedy_streams import sample_metric_async
from tests.e2e.stack import StackSpec, run_stack
from tests.k8s.monitoring_queries import SYNTHETIC, metric_names, queries

pytestmark = pytest.mark.e2e
API_KEY = "dashboard-test-key"
#: the latest screenshot, kept where a person can open it
SCREENSHOT = Path(__file__).resolve().parents[2] / ".specfleet" / "test-output" / "dashboard.png"


@dataclass
class Live:
    stack: Fleet
    drafter_metrics: list[str]


PROMPTS = ["def main(", "class Queue:", "import os\n", "for i in range("]


async def traffic(base_url: str, stop: asyncio.Event) -> int:
    """Completions back to back from two clients until ``stop``; how many finished."""
    done = 0

    async def client(i: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            while not stop.is_set():
                body = {"model": "target", "prompt": PROMPTS[(done + i) % len(PROMPTS)], "max_tokens": 48}
                resp = await http.post(f"{base_url}/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                done += 1

    await asyncio.gather(client(0), client(1))
    return done


async def status_cli(base_url: str) -> tuple[int, str]:
    """``specfleet status`` against the fleet: its exit code and output."""
    argv = [sys.executable, "-m", "shared.cli", "status", "--url", base_url, "--api-key", API_KEY]
    proc = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "COLUMNS": "200"})
    return proc.returncode, proc.stdout + proc.stderr


def text(selector: str) -> str:
    return f"(document.querySelector({selector!r}) || {{}}).textContent || ''"


async def watch_live(page: Page, stack: Fleet, shot: Path) -> None:
    await page.send("Page.navigate", url=f"{stack.base_url}/dashboard")
    await page.wait_for("document.querySelectorAll('#drafters tbody tr[data-node]').length === 2")
    assert await page.evaluate(text("#status")) == "ready"
    first = await page.wait_for(f"(t => t !== '–' && parseFloat(t) > 0 && t)({text('#tokens-s')})")
    updated = await page.evaluate(text("#updated"))
    await page.wait_for(f"{text('#updated')} !== {updated!r}")  # polled again
    await page.wait_for(f"{text('#tokens-s')} !== {first!r}")  # and the numbers moved
    await page.wait_for("history.length >= 8 && Object.keys(history[history.length - 1].acceptance).length >= 1")
    drafted = "[...document.querySelectorAll('#drafters tbody tr')].map(r => parseFloat(r.cells[4].textContent))"
    await page.wait_for(f"{drafted}.some(v => v > 0)")  # drafted tokens/s
    rows = await page.evaluate("[...document.querySelectorAll('#drafters tbody tr')].map(r => r.dataset.node)")
    assert sorted(rows) == ["drafter-1", "drafter-2"]
    assert await page.evaluate("document.querySelectorAll('#legend span').length") >= 1
    assert await page.evaluate(f"/\\d/.test({text('#ttft')}) && /\\d/.test({text('#speedup')})")
    await page.screenshot(shot)
    code, out = await status_cli(stack.base_url)
    assert code == 0 and "READY" in out and "drafter-1" in out and "drafter-2" in out, out


async def watch_faults(page: Page, stack: Fleet) -> None:
    children = {c.name: c for c in stack.supervisor.children}
    for name in ("drafter-1", "drafter-2"):
        os.kill(children[name].proc.pid, signal.SIGKILL)
    await page.wait_for(f"{text('#drafters td.empty')}.includes('No drafter connected')")
    await page.wait_for(f"{text('#banner')}.includes('no drafter is connected')")
    assert await page.evaluate(text("#status")) == "not ready"
    code, out = await status_cli(stack.base_url)
    assert code == 1 and "NOT READY" in out and "no drafter connected" in out, out
    os.kill(children["verifier"].proc.pid, signal.SIGKILL)
    await page.wait_for(f"{text('#verifiers td.down')} === 'unreachable'")
    await page.wait_for(f"{text('#banner')}.includes('verifier link is down')")


@pytest.fixture(scope="module")
def live(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """Two drafters with their /metrics ports, a coordinator with an API key. The browser test,
    last in this module, kills the drafters and the verifier."""
    ports = [free_port(), free_port()]
    spec = StackSpec(drafts=[tiny_models["draft-L1"], tiny_models["draft-L2"]],
                     extra_coordinator=["--api-key", API_KEY], per_drafter=[["--metrics-port", str(p)] for p in ports])
    with run_stack(tiny_models["target"], spec, tmp_path_factory.mktemp("dashboard") / "logs") as stack:
        yield Live(stack, [f"http://127.0.0.1:{p}" for p in ports])


def test_every_metric_the_dashboards_and_alerts_query_is_exported(live: Live) -> None:
    """Each metric a Grafana panel or an alert selects is on some service's /metrics, after traffic."""
    asyncio.run(_some_traffic(live.stack.base_url, live.drafter_metrics))
    exported: set[str] = set()
    for url in (live.stack.base_url, live.stack.verifier_url, *live.drafter_metrics):
        exported |= {line.split("{")[0].split(" ")[0] for line in httpx.get(f"{url}/metrics").text.splitlines()
                     if line and not line.startswith("#")}
    wanted = {name: where for where, expr in queries().items() for name in metric_names(expr)}
    missing = {name: where for name, where in wanted.items() if name not in exported | SYNTHETIC}
    assert not missing, f"queried but exported by no service: {missing}"


async def _some_traffic(base_url: str, drafters: list[str]) -> None:
    """3 s of traffic, and on until every drafter has played a round (its labelled series exist):
    a slow host's few requests may all have gone to one drafter."""
    stop = asyncio.Event()
    load = asyncio.create_task(traffic(base_url, stop))
    await asyncio.sleep(3)
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline and not all(
                [await sample_metric_async(http, f"{url}/metrics", "specfleet_drafter_rounds_total") > 0
                 for url in drafters]):
            await asyncio.sleep(0.2)
    stop.set()
    assert await load > 0


def test_dashboard_in_headless_chromium(live: Live, tmp_path: Path) -> None:
    assert chromium_binary(), "the dashboard test needs Chromium: run scripts/ensure-chromium.sh (apt chromium)"
    stack = live.stack
    refused = httpx.get(f"{stack.base_url}/dashboard")
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
    basic = base64.b64encode(f"operator:{API_KEY}".encode()).decode()

    async def scenario() -> None:
        stop = asyncio.Event()
        load = asyncio.create_task(traffic(stack.base_url, stop))
        try:
            async with open_page(tmp_path / "profile", {"Authorization": f"Basic {basic}"}) as page:
                await watch_live(page, stack, tmp_path / "dashboard.png")
                stop.set()
                assert await load > 0
                await watch_faults(page, stack)
                assert page.errors == [], page.errors
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await load

    asyncio.run(asyncio.wait_for(scenario(), 240))
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tmp_path / "dashboard.png", SCREENSHOT)
