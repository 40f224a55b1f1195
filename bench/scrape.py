"""Reading the services' Prometheus /metrics: snapshots, and what happened between two of them."""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


class Snapshot(dict[Key, float]):
    """One scrape: every sample by name and labels."""

    def value(self, name: str, **labels: str) -> float:
        return self.get((name, tuple(sorted(labels.items()))), 0.0)

    def __sub__(self, earlier: Snapshot) -> Snapshot:
        return Snapshot({k: v - earlier.get(k, 0.0) for k, v in self.items()})

    def mean(self, histogram: str, **labels: str) -> float:
        """Mean of a histogram's observations (0 when it has none)."""
        count = self.value(f"{histogram}_count", **labels)
        return self.value(f"{histogram}_sum", **labels) / count if count else 0.0

    def count(self, histogram: str, **labels: str) -> float:
        return self.value(f"{histogram}_count", **labels)

    def total(self, name: str) -> float:
        """A sample summed over all its label sets (vLLM labels every metric by engine and model)."""
        return sum(v for (n, _), v in self.items() if n == name)


def scrape(url: str, timeout_s: float = 10.0) -> Snapshot:
    text = httpx.get(url, timeout=timeout_s).text
    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            snap[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return snap


def scrape_all(urls: dict[str, str]) -> dict[str, Snapshot]:
    return {name: scrape(url) for name, url in urls.items()}


def diff_all(after: dict[str, Snapshot], before: dict[str, Snapshot]) -> dict[str, Snapshot]:
    return {name: after[name] - before.get(name, Snapshot()) for name in after}


def merged(snaps: list[Snapshot]) -> Snapshot:
    """Several drafters' snapshots summed into one."""
    out: defaultdict[Key, float] = defaultdict(float)
    for snap in snaps:
        for k, v in snap.items():
            out[k] += v
    return Snapshot(out)
