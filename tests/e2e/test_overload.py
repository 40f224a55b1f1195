"""Overload: a burst of 4x what the coordinator admits, against the real services.

Every request the coordinator accepts completes in full; the others get 429 with Retry-After in
the OpenAI error shape; none gets a 500. Repeating the burst leaves the services' memory where
the first burst left it (every queue is bounded, the KV cache is preallocated), and the
in-flight gauge returns to 0.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import StackSpec, run_stack

CAP = 4
BURST = 4 * CAP
TOKENS = 24
#: RSS a service may gain between the first and the last burst (allocator noise, not leaks)
RSS_SLACK_KB = 48 * 1024


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _burst(base_url: str, model: str) -> list[tuple[int, dict[str, object], str]]:
    body = {"model": model, "prompt": "def main():\n", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        replies = await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(BURST)])
    return [(r.status_code, r.json(), r.headers.get("retry-after", "")) for r in replies]


@pytest.mark.e2e
def test_overload_burst_completes_every_accepted_request(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    spec = StackSpec(drafts=[tiny_models["draft-L1"]], extra_coordinator=["--max-in-flight", str(CAP)])
    with run_stack(tiny_models["target"], spec, tmp_path / "logs") as stack:
        pids = {c.name: c.proc.pid for c in stack.supervisor.children}
        rss: list[dict[str, int]] = []
        for _ in range(3):
            replies = asyncio.run(_burst(stack.base_url, tiny_models["target"].name))
            rss.append({name: _rss_kb(pid) for name, pid in pids.items()})
            statuses = Counter(status for status, _, _ in replies)
            assert set(statuses) <= {200, 429}, statuses
            assert statuses[200] >= CAP, statuses
            for status, body, retry_after in replies:
                if status == 200:
                    assert body["usage"]["completion_tokens"] == TOKENS  # type: ignore[index]
                else:
                    assert retry_after.isdigit() and body["error"]["code"] == "rate_limit_exceeded"  # type: ignore[index]
        metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        assert "specfleet_coordinator_requests_in_flight 0.0" in metrics
    for name in pids:
        assert rss[-1][name] - rss[0][name] < RSS_SLACK_KB, f"{name} grew from {rss[0][name]} to {rss[-1][name]} kB"
