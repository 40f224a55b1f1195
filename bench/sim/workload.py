"""What a real run's rows say of its workload beyond their own fields, for the validation
(``validate.py``): how long its prompts were, when a closed loop's first requests started, and
the round trip its edge network added."""

from __future__ import annotations

import re
from typing import Any

PROMPT_LEN = 12  # a prompt's length in target tokens for an older results file (``prompt_len_of``)
TARGET_ONLY = ("centralized", "no speculation", "target-only")


def prompt_len_of(rows: list[dict[str, Any]]) -> int:
    """A results file's prompts' mean length in target tokens, which all its rows share: what the
    verifier prefilled per request (``costs.prefill_tokens``, runs since 2026-11-27 21:50), plus the
    last prompt token, which a request's first round feeds; the most over its speculative rows.
    The count is short of the prompts by what first rounds fed themselves: a round whose draft
    comes before its prompt is cached feeds the rest with its drafts (in the fairness run of 21:54,
    11.0, 8.2 and 7.7 tokens a request under its three policies, on the same prompts). A
    target-only request feeds its whole prompt in its first round, uncounted; a SLED-like verifier
    prefills every round. Prompt tokens copied from another request's shared prefix are left out,
    as the simulated verifier does not share (none were in these runs). ``PROMPT_LEN`` for an
    older file."""
    counts = []
    for row in rows:
        requests = sum(c.get("requests", 0.0) for c in row.get("slo", {}).values())
        prefill = row.get("costs", {}).get("prefill_tokens", 0.0)
        if prefill > 0 and requests > 0 and row["scenario"] not in (*TARGET_ONLY, "SLED-like"):
            counts.append(prefill / requests)
    return max(1, round(max(counts)) + 1) if counts else PROMPT_LEN


def first_sends_s(row: dict[str, Any], repeat: int) -> list[float]:
    """When a closed-loop row's client sent its first requests in its ``repeat``-th repeat (seconds;
    ``first_sends_ms_runs``, runs since 2026-11-28; empty before). Drafter i takes every n-th."""
    runs = row.get("first_sends_ms_runs") or []
    return [t / 1e3 for t in runs[min(repeat, len(runs) - 1)]] if runs else []


def configured_rtt_ms(row: dict[str, Any]) -> float:
    """The round trip the row's edge network added to every drafter (its ``network``, e.g. "edge
    network: netns, RTT +40 ms"); 0 on loopback. The fairness runs' drafters add their own too
    (the file's ``meta.drafters``)."""
    found = re.search(r"RTT \+([0-9.]+) ms", str(row.get("network", "")))
    return float(found.group(1)) if found else 0.0

