"""Incremental detokenisation with stop strings, for the text a session publishes.

Text is released only when it is settled: an incomplete UTF-8 sequence (decoded as U+FFFD at
the end) is held back, and so are the last ``len(longest stop) - 1`` characters, because they
might still turn into a stop string. When a stop string appears, the text is cut before it.
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._tok = tokenizer
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0  # characters of the full text already released
        self.text = ""  # full settled-or-not text of the generated tokens

    def push(self, token_id: int) -> bool:
        """Add one generated token. Returns True if a stop string now ends the text."""
        self._ids.append(token_id)
        self.text = self._tok.decode(self._ids, skip_special_tokens=True)
        start = max(0, self._emitted - self._hold - 1)
        cut = min((i for i in (self.text.find(s, start) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return True
        return False

    def release(self, final: bool) -> str:
        """The new settled text since the last release (everything, when final)."""
        end = len(self.text)
        if not final:
            # A trailing U+FFFD is a character still being decoded: it is not settled text and
            # must not use up any of the hold-back kept for a possible stop string.
            end = len(self.text.rstrip("\ufffd")) - self._hold
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
