"""Incremental detokenisation with stop strings, for the text a session publishes.

Each token costs amortised O(1): a fast tokenizer decodes the stream itself (``DecodeStream``,
which also holds back an incomplete UTF-8 sequence until it completes); other tokenizers decode
a short window of recent tokens, as vLLM's and TGI's incremental detokenizers do. Only the
unreleased tail of the text is kept and searched for stop strings.

Text is released only when it is settled: the last ``len(longest stop) - 1`` characters are
held back, because they might still turn into a stop string. When a stop string appears, the
text is cut before it.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

#: tokens of context the window decoder re-decodes (enough to settle a multi-token character)
WINDOW_CONTEXT = 6


class _WindowDecoder:
    """Fallback for tokenizers without a Rust backend: decode(prefix + new) - decode(prefix)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window
        self._read = 0  # tokens whose text was already returned

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._take(final=False)

    def flush(self) -> str:
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        done = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        full = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if (full.endswith("\ufffd") and not final) or len(full) <= len(done):
            return ""  # an incomplete character, or a token that adds no text yet
        self._prefix = max(self._prefix, len(self._ids) - WINDOW_CONTEXT)
        self._read = len(self._ids)
        return full[len(done) :]


class _StreamDecoder:
    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []  # tokens of a character not complete yet

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id) or ""
        self._held = [] if piece else [*self._held, token_id]
        return piece

    def flush(self) -> str:
        """At the end: the bytes of an unfinished character, as a full decode renders them."""
        held, self._held = self._held, []
        return self._backend.decode(held, skip_special_tokens=True) if held else ""


class IncrementalText:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decoder = _StreamDecoder(backend) if backend is not None else _WindowDecoder(tokenizer)
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # decoded text not yet released
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add one generated token. Returns True if a stop string now ends the text."""
        piece = self._decoder.step(token_id)
        if not piece or self.stopped:
            return self.stopped
        self._pending += piece
        if self._stops:
            cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
            if cut >= 0:
                self._pending = self._pending[:cut]
                self.stopped = True
        return self.stopped

    def prime(self, token_ids: list[int], released_chars: int) -> None:
        """Replay tokens already generated (a re-opened request), of whose text the client already
        got the first ``released_chars`` characters: only the held-back rest stays pending, so a
        stop string across the boundary is still found and no character is sent twice."""
        for token in token_ids:
            self.push(token)
        drop = min(released_chars, len(self._pending))
        self._pending = self._pending[drop:]

    def release(self, final: bool) -> str:
        """The new settled text since the last release (everything, when final)."""
        if final and not self.stopped:
            self._pending += self._decoder.flush()
        keep = 0 if final or self.stopped else self._hold
        if len(self._pending) <= keep:
            return ""
        out, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
        return out
