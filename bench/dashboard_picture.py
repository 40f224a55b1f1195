"""The README's dashboard picture, taken from the default fleet serving the bundled chat prompts.

    python -m bench dashboard-picture [--out docs/images/dashboard.png] [--concurrency 2] [--seconds 45]

Starts the default fleet as ``bench edge-drafts`` does (the real target, its Q4_1 and Q8_0 GGUF
copies as the two drafters, ``--speculation auto``; the verifier on CPU 0, the rest on CPU 1),
sends the held-out chat prompts from ``--concurrency`` clients back to back, opens the
coordinator's ``/dashboard`` in headless Chromium (Debian's ``chromium``:
``scripts/ensure-chromium.sh``) and, after ``--seconds`` of traffic, with both drafters listed and
an estimated speedup shown, saves a screenshot to ``--out``. Prints what the page showed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path

from bench.browser import open_page
from bench.client import run_load
from bench.edge import add_edge_flags, edge_from
from bench.edge_drafts import chat_bodies, heldout_prompts, scenarios
from bench.fleets import BenchFleet, bench_fleet
from shared.up import resolve_models

SHOWN = {"tokens/s": "#tokens-s", "est. speedup": "#speedup", "TPOT": "#tpot", "status": "#status"}


async def traffic(bf: BenchFleet, model: str, concurrency: int, stop: asyncio.Event) -> int:
    """The held-out chat prompts, ``concurrency`` at a time, round after round until ``stop``."""
    rounds = 0
    prompts = heldout_prompts(max(8, concurrency))
    while not stop.is_set():
        await run_load(bf.fleet.ws_url, chat_bodies(prompts, 128, model, 0.0), concurrency)
        rounds += 1
    return rounds


async def take(bf: BenchFleet, model: str, out: Path, concurrency: int, seconds: float) -> dict[str, str]:
    stop = asyncio.Event()
    load = asyncio.create_task(traffic(bf, model, concurrency, stop))
    try:
        with tempfile.TemporaryDirectory(prefix="specfleet-chromium-") as profile:
            async with open_page(Path(profile)) as page:
                await page.send("Page.navigate", url=f"{bf.fleet.base_url}/dashboard")
                await page.wait_for("document.querySelectorAll('#drafters tbody tr[data-node]').length === 2", 60)
                await asyncio.sleep(seconds)
                await page.wait_for("(document.querySelector('#speedup') || {}).textContent !== '–'", 60)
                out.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(out)
                return {name: await page.evaluate(f"document.querySelector({sel!r}).textContent")
                        for name, sel in SHOWN.items()}
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench dashboard-picture", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/images/dashboard.png", help="where the screenshot goes")
    p.add_argument("--concurrency", type=int, default=2, help="clients sending chat requests at once")
    p.add_argument("--seconds", type=float, default=45.0, help="traffic before the picture (the charts fill)")
    p.add_argument("--target", default="", help="target model directory (default: the fetched default model)")
    add_edge_flags(p)
    args = p.parse_args(argv)
    edge = edge_from(args)
    edge.pin_self_to_edge()
    target = resolve_models(args.target, "", Path.cwd(), Path(".specfleet")).target
    with tempfile.TemporaryDirectory() as logs, \
            bench_fleet(target, scenarios(target)["default-fleet"], edge, Path(logs)) as bf:
        shown = asyncio.run(take(bf, target.name, Path(args.out), args.concurrency, args.seconds))
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    return 0
