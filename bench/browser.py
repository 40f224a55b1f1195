"""Headless Chromium, driven over the Chrome DevTools protocol (a WebSocket: no extra package).

``open_page`` starts Debian's ``chromium`` with a throw-away profile, attaches to its page and
records every console error, uncaught exception and failed log entry, so that a test can assert
on the DOM (``evaluate``), wait for a condition (``wait_for``), and save a screenshot. The
dashboard's browser test drives it, and ``python -m bench dashboard-picture`` takes the README's
picture with it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_binary() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class Page:
    """One browser tab: commands go out with ids, events are kept for the checks."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                msg = json.loads(raw)
                if "id" in msg and msg["id"] in self._waiting:
                    self._waiting.pop(msg["id"]).set_result(msg)
                else:
                    self._event(msg.get("method", ""), msg.get("params", {}))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = (str(a.get("value", a.get("description"))) for a in params["args"])
            self.errors.append("console: " + " ".join(args))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[msg_id] = future
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still falsy after {timeout_s} s: {expression}")
            await asyncio.sleep(0.2)

    async def screenshot(self, path: Path) -> None:
        data = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))


@contextlib.asynccontextmanager
async def open_page(profile: Path, headers: dict[str, str] | None = None,
                    size: tuple[int, int] = (1280, 900)) -> AsyncIterator[Page]:
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("no Chromium found: install Debian's chromium (apt-get install chromium)")
    args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}", "about:blank"]
    profile.mkdir(parents=True, exist_ok=True)
    log = profile / "chromium.log"
    with log.open("wb") as out:
        # its settings, crash database and caches in the profile too (else ~/.config, ~/.cache)
        env = {**os.environ, "LANG": "C", "XDG_CONFIG_HOME": str(profile / "config"),
               "XDG_CACHE_HOME": str(profile / "cache")}
        proc = subprocess.Popen(args, stderr=out, stdout=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # its own process group: every helper goes with it
    try:
        browser_ws = await asyncio.to_thread(_devtools_url, proc, log)
        page_ws = await _page_url(browser_ws)
        async with connect(page_ws, max_size=64 * 1024 * 1024) as ws:
            page = Page(ws)
            for domain in ("Runtime", "Log", "Page", "Network"):
                await page.send(f"{domain}.enable")
            if headers:
                await page.send("Network.setExtraHTTPHeaders", headers=headers)
            yield page
            page._reader.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)


def _devtools_url(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> str:
    """The browser's DevTools WebSocket, as chromium prints it to stderr (here: ``log``)."""
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if match := LISTENING.search(text):
            return match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("chromium did not open its DevTools port:\n" + "\n".join(text.splitlines()[-20:]))


async def _page_url(browser_ws: str) -> str:
    """The WebSocket of the browser's first page (the about:blank tab it opened with)."""
    http = browser_ws.replace("ws://", "http://").split("/devtools/")[0]
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(50):
            pages = [t for t in (await client.get(f"{http}/json/list")).json() if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
            await asyncio.sleep(0.1)
    raise RuntimeError("chromium opened no page")
