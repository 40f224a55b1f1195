"""``specfleet status``: the fleet in a terminal, from a coordinator's ``GET /v1/fleet``.

    specfleet status [--url http://127.0.0.1:8000] [--api-key KEY] [--watch [--interval 1]] [--json]

One table of the fleet's speed and requests, one line per verifier and one per drafter: what the
dashboard shows. Exit status: 0 when the fleet is ready, 1 when it is not (or the coordinator
cannot be read; the reason is printed), 2 for bad usage. ``--watch`` redraws until Ctrl-C and
exits with the last reading's status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

DEFAULT_URL = "http://127.0.0.1:8000"
DESCRIPTION = ("The fleet (verifiers, drafters, speed, requests) from a coordinator's GET /v1/fleet; exit 1 when "
               "it is not ready.")


class Unreadable(Exception):
    """The coordinator could not be read; the message says why and what to do."""


def fetch(url: str, api_key: str, timeout_s: float = 5.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/fleet", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise Unreadable(f"cannot reach the coordinator at {url}: {exc!r}. Is it running (make run)? "
                         "Pass --url to point elsewhere.") from None
    if resp.status_code == 401:
        raise Unreadable(f"{url} refused the API key (401): pass --api-key or set SPECFLEET_API_KEY")
    if resp.status_code != 200:
        raise Unreadable(f"{url}/v1/fleet answered {resp.status_code}: {resp.text.strip()[:300]}")
    view: dict[str, Any] = resp.json()
    return view


def _num(value: float | None, fmt: str = "{:.1f}", unit: str = "") -> str:
    return "–" if value is None else fmt.format(value) + unit


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.1f} ms"


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


def summary(view: dict[str, Any]) -> Table:
    s, r = view["speed"], view["requests"]
    table = Table(title="fleet", title_justify="left", box=None, pad_edge=False)
    for column in ("tokens/s", "TTFT p50/p99", "TPOT p50/p99", "tokens/fwd", "est. speedup", "in flight", "queued",
                   "429"):
        table.add_column(column, justify="right")
    table.add_row(_num(s["tokens_s"]), f"{_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])}",
                  f"{_ms(s['tpot_p50_s'])} / {_ms(s['tpot_p99_s'])}", _num(s["tokens_per_forward"], "{:.2f}"),
                  _num(s["speedup_estimate"], "{:.2f}", "×"), str(r["in_flight"]),
                  "unknown" if r["queued"] is None else str(r["queued"]), str(r["rejected_429"]))
    return table


def verifiers(view: dict[str, Any]) -> Table:
    table = Table(title="verifiers", title_justify="left")
    for column in ("verifier", "state", "backend", "model", "dtype", "sessions", "batch", "step", "KV used/free"):
        table.add_column(column)
    for v in view["verifiers"]:
        if not v["up"]:
            table.add_row(v["url"], Text("unreachable", style="bold red"), v["error"], "", "", "", "", "", "")
            continue
        kv = v["kv"] or {}
        table.add_row(v["url"], "up" if v["ready"] else "starting", v["engine"]["backend"], v["engine"]["model"],
                      v["engine"]["dtype"], str(v["sessions"]), _num(v["batch_sessions"]),
                      _num(v["step_ms"], unit=" ms"), f"{_bytes(kv.get('reserved_bytes'))} / "
                      f"{_bytes(kv.get('free_bytes'))}")
    return table


def drafters(view: dict[str, Any]) -> Table | Text:
    if not view["drafters"]:
        return Text("no drafter connected: requests are served by the target alone", style="yellow")
    table = Table(title="drafters", title_justify="left")
    for column in ("node", "model", "sessions", "acceptance", "drafted tok/s", "RTT", "budget", "trusted", "since"):
        table.add_column(column)
    for d in view["drafters"]:
        table.add_row(d["node"], d["model"], str(d["sessions"]), _num(d["acceptance"] and 100 * d["acceptance"],
                                                                      "{:.0f}", " %"),
                      _num(d["drafted_tokens_s"]), _num(d["rtt_ms"], unit=" ms"), _num(d["budget"]),
                      "yes" if d["trusted"] else "no (ids only)",
                      datetime.fromtimestamp(d["connected_since"]).strftime("%H:%M:%S"))
    return table


def render(view: dict[str, Any]) -> RenderableType:
    ready = view["status"] == "ready"
    head = Text.assemble(("specfleet ", "bold"), (f"{view['coordinator']}  ", "dim"),
                         ("READY" if ready else "NOT READY", "bold green" if ready else "bold red"))
    parts: list[RenderableType] = [head]
    parts += [Text(f"  · {reason}", style="red") for reason in view["missing"]]
    parts += [summary(view), verifiers(view), drafters(view)]
    return Group(*parts)


def watch(read: Callable[[], dict[str, Any]], console: Console, interval_s: float) -> int:
    code = 1
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                try:
                    view = read()
                    code = 0 if view["status"] == "ready" else 1
                    live.update(render(view), refresh=True)
                except Unreadable as exc:
                    code = 1
                    live.update(Text(str(exc), style="bold red"), refresh=True)
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return code


def status_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specfleet status", description=DESCRIPTION)
    parser.add_argument("--url", default=os.environ.get("SPECFLEET_URL", DEFAULT_URL),
                        help=f"the coordinator's base URL (env SPECFLEET_URL; default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get("SPECFLEET_API_KEY", ""),
                        help="the API key, when the coordinator has one (env SPECFLEET_API_KEY)")
    parser.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    parser.add_argument("--interval", type=float, default=1.0, help="--watch: seconds between readings (default 1)")
    parser.add_argument("--json", action="store_true", help="print /v1/fleet's JSON instead of tables")
    args = parser.parse_args(list(argv))
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    console = Console()
    if args.watch:
        return watch(lambda: fetch(args.url, args.api_key), console, args.interval)
    try:
        view = fetch(args.url, args.api_key)
    except Unreadable as exc:
        print(f"specfleet status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(view, indent=1))
    else:
        console.print(render(view))
    return 0 if view["status"] == "ready" else 1
