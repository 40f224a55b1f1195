"""The verifier backend interface: what the engine needs from whatever runs the target model.

A backend keeps each session's target KV cache across rounds. One ``score`` call runs the
new tokens of many sessions in one batched forward pass and returns one logits row per new
token. ``commit`` then tells it how many of those tokens were kept, so it can roll the cache
back past rejected drafts. The engine does all sampling and acceptance math itself.

Cache invariant, per session: the cache holds every committed token except the last one. A
round feeds ``[last committed token] + drafts``; row j of the result is the target's logits for
the position after new token j.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ScoreItem:
    session_id: str
    input_ids: list[int]  # last committed token, then the drafts


@dataclass(frozen=True)
class KVStats:
    sessions: int
    cached_tokens: int  # tokens held across all sessions
    bytes: int  # memory the caches use


class BackendError(RuntimeError):
    """The backend could not serve a call (unknown session, out of memory, ...)."""


class VerifierBackend(Protocol):
    """Runs the target model. Implementations: torch (transformers); vLLM later."""

    vocab_size: int
    max_model_len: int

    def open(self, session_id: str, prompt_ids: list[int]) -> None:
        """Prefill ``prompt_ids[:-1]`` into a new cache for the session."""

    def score(self, items: list[ScoreItem]) -> list[torch.Tensor]:
        """One batched forward pass; returns logits ``[len(item.input_ids), V]`` per item (float32)."""

    def commit(self, session_id: str, keep: int) -> None:
        """Keep the first ``keep`` of the tokens the last ``score`` fed for this session."""

    def close(self, session_id: str) -> None:
        """Drop the session's cache (idempotent)."""

    def kv_stats(self) -> KVStats: ...
