"""A model's token-id table, summarised: what a drafter and a verifier compare when one joins the
other (``shared.models.tokenizer_vocabulary`` for a Hugging Face tokenizer, ``shared.gguf_files``
for a GGUF file). Imports nothing heavy."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Vocabulary:
    """What makes two models' token ids interchangeable, and a line that tells people which it is.

    ``fingerprint`` covers the id -> token table and the eos/bos ids (a drafter joins a verifier
    whose fingerprint is the same); ``ids_fingerprint`` the table alone (the same token ids, with
    other special-token roles: a GGUF copy's converter may name another bos, say). ``summary``
    names the vocabulary in an error message: its size, its eos token and the ids fingerprint."""

    size: int
    fingerprint: str
    ids_fingerprint: str
    summary: str

    @classmethod
    def of(cls, table: Sequence[tuple[str, int]], eos: int | None, bos: int | None) -> Vocabulary:
        """``table``: (token, id) pairs in id order."""
        vocab = [list(pair) for pair in table]
        full = json.dumps({"vocab": vocab, "eos": eos, "bos": bos}, ensure_ascii=False, separators=(",", ":"))
        ids = json.dumps(vocab, ensure_ascii=False, separators=(",", ":"))
        ids_print = hashlib.sha256(ids.encode()).hexdigest()[:16]
        names = {i: t for t, i in table}
        eos_text = f"eos {names.get(eos, '?')!r} = {eos}" if eos is not None else "no eos"
        return cls(size=len(table), fingerprint=hashlib.sha256(full.encode()).hexdigest()[:16],
                   ids_fingerprint=ids_print, summary=f"{len(table)} tokens, {eos_text}, ids {ids_print}")
