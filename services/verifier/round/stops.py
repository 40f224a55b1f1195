"""When a request stops: every rule in one place.

Token-level rules (an end-of-sequence or stop token, ``max_tokens``, the context limit) are
decided by the engine core as it commits a round's tokens (:meth:`Stops.after`), and by the event
loop for a re-opened request that had already reached its length (:meth:`Stops.length_reached`).
Stop *strings* are text: the event loop's output side finds them in the session's incremental
detokenizer (:func:`cut_at_stop_string`) and finishes the request in the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.protocol import FinishReason, SamplingParams


@dataclass(frozen=True)
class Stops:
    prompt_len: int
    max_tokens: int
    max_model_len: int
    stop_ids: frozenset[int]  # end-of-sequence ids (unless ignore_eos) and the request's stop_token_ids

    @classmethod
    def of(cls, params: SamplingParams, prompt_len: int, eos_ids: frozenset[int], max_model_len: int) -> Stops:
        eos = frozenset() if params.ignore_eos else eos_ids
        return cls(prompt_len, params.max_tokens, max_model_len, eos | frozenset(params.stop_token_ids))

    def after(self, token: int, context_len: int) -> FinishReason | None:
        """Why the request stops once ``token`` is committed, its context then ``context_len`` long."""
        if token in self.stop_ids:
            return "stop"
        return "length" if self.length_reached(context_len) else None

    def length_reached(self, context_len: int) -> bool:
        return context_len - self.prompt_len >= self.max_tokens or context_len >= self.max_model_len

    def draft_room(self, context_len: int) -> int:
        """Draft tokens a round may verify without crossing the context limit (its own token included)."""
        return max(0, self.max_model_len - context_len - 1)

    def kv_tokens_needed(self, max_draft_tokens: int) -> int:
        """KV rows to reserve: everything the request can ever hold, so it never runs out."""
        return min(self.max_model_len, self.prompt_len + self.max_tokens + max_draft_tokens)


class Text(Protocol):
    """A session's incremental detokenizer (``detok.IncrementalText``)."""

    def push(self, token: int) -> bool: ...  # True: a stop string has ended the text


def cut_at_stop_string(text: Text, tokens: list[int]) -> tuple[list[int], bool]:
    """Push ``tokens`` through ``text``: those kept (up to the one completing a stop string), and
    whether a stop string ended the request."""
    kept: list[int] = []
    for token in tokens:
        kept.append(token)
        if text.push(token):
            return kept, True
    return kept, False
