"""FCFS batching: the sessions that became ready first, up to the batch limits (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from services.verifier.batching.base import BatchLimits, Candidate


class FcfsBatcher:
    name = "fcfs"

    def select(self, ready: Sequence[Candidate], limits: BatchLimits) -> list[str]:
        chosen: list[str] = []
        tokens = 0
        for cand in sorted(ready, key=lambda c: c.ready_since):
            if len(chosen) >= limits.max_sessions:
                break
            if chosen and tokens + cand.new_tokens > limits.max_tokens:
                continue  # a later, smaller session may still fit
            chosen.append(cand.session_id)
            tokens += cand.new_tokens
        return chosen

    def riders_fit(self, cached: Sequence[int]) -> int:
        return len(cached)  # any the step's limits allow
