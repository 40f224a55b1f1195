"""Logprobs in OpenAI's response shapes, from the TokenLogprobs the verifier sends.

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``

A token's text is its own decoding (special tokens included). Logprobs of -inf (a token the
processed distribution cut away) become -9999.0, as vLLM sends them: JSON has no infinity.
One :class:`LogprobsFormatter` per request keeps each choice's ``text_offset`` running across
stream chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from services.coordinator.fields import Kind
from shared.protocol import TokenLogprob

FLOOR = -9999.0


def _finite(x: float) -> float:
    return FLOOR if math.isnan(x) or x < FLOOR else x


class LogprobsFormatter:
    def __init__(self, kind: Kind, token_strings: Callable[[list[int]], list[str]], text_offset: int = 0) -> None:
        self.kind = kind
        self.strings = token_strings
        self.start = text_offset
        self.offsets: dict[int, int] = {}  # completions, per choice: where its next token's text starts

    def format(self, token_ids: list[int], logprobs: list[TokenLogprob], index: int = 0) -> dict[str, Any]:
        """The ``logprobs`` object of a choice covering ``token_ids`` (one chunk's, or the whole text)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs entries")
        texts = self.strings(token_ids)
        tops = [self.strings(lp.top_ids) for lp in logprobs]
        if self.kind == "chat":
            return {"content": [_chat_entry(t, lp, top) for t, lp, top in zip(texts, logprobs, tops, strict=True)]}
        offsets, at = [], self.offsets.get(index, self.start)
        for t in texts:
            offsets.append(at)
            at += len(t)
        self.offsets[index] = at
        return {
            "tokens": texts,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [dict(zip(top, map(_finite, lp.top_logprobs), strict=True))
                             for lp, top in zip(logprobs, tops, strict=True)],
            "text_offset": offsets,
        }


def _chat_entry(text: str, lp: TokenLogprob, top: list[str]) -> dict[str, Any]:
    entry = _token(text, lp.logprob)
    entry["top_logprobs"] = [_token(t, x) for t, x in zip(top, lp.top_logprobs, strict=True)]
    return entry


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
