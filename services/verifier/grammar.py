"""Structured output: a grammar's mask on p at every verified position, with llguidance.

The target's distribution under a grammar is p masked to the tokens the grammar allows after
the text so far, renormalised. Verifying k drafts needs the mask at each of the k + 1 positions,
each after its own prefix: :meth:`Grammar.masks` advances the matcher over the drafts (stopping
at the first one the grammar refuses: that draft is rejected whatever happens, since its masked
p is 0, and later rows are never read), then rolls back. Only committed tokens advance the
grammar for good (:meth:`Grammar.advance`). Drafters draft unmasked: acceptance is lossless
whatever q is.

llguidance was chosen by measurement on the test tokenizer (a byte-level BPE): it consumed a
valid JSON tokenization where xgrammar 0.2.8 rejected one of its tokens, and its masks cost
~0.2 ms per position there. JSON is generated without free whitespace (compact JSON, still
JSON), so a schema with bounded values always ends.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
import llguidance.hf
import torch

from shared.log import get_logger
from shared.protocol import Structured

log = get_logger("verifier.grammar")


class GrammarError(ValueError):
    """The request's grammar (schema, regex, choices) is not usable; the message says why."""


def grammar_text(spec: Structured) -> str:
    """The llguidance grammar of a request's structured-output spec."""
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec)
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.spec))
    choices = json.loads(spec.spec)
    return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))


class Grammars:
    """The verifier's tokenizer as llguidance sees it; builds one matcher per request."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._compiled = lru_cache(maxsize=256)(self._compile)

    def _compile(self, spec: Structured) -> str:
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the {spec.kind} is not usable: {exc}") from None
        problem = llguidance.LLMatcher.validate_grammar(text, self._tokenizer)
        if problem:
            raise GrammarError(f"the {spec.kind} is not usable: {problem}")
        return text

    def matcher(self, spec: Structured) -> Grammar:
        """A fresh matcher for ``spec``; raises GrammarError if the grammar does not compile."""
        matcher = llguidance.LLMatcher(self._tokenizer, self._compiled(spec))
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} is not usable: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)


class Grammar:
    """One request's grammar state: the committed text's, advanced only by committed tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def _mask(self) -> torch.Tensor:
        """The tokens allowed next, as a bool vector; all of them if the matcher is in error
        (it cannot be, since only allowed tokens are committed; this only keeps p defined)."""
        if self._m.is_error():
            log.warning("grammar matcher in error; position left unmasked", error=self._m.get_error())
            return torch.ones(self.vocab_size, dtype=torch.bool)
        allowed = torch.frombuffer(bytearray(self._m.compute_logit_bias()), dtype=torch.uint8) != 0
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, allowed.shape[0])
        mask[:n] = allowed[:n]
        return mask

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """``[k + 1, V]``: row j allows what the grammar allows after the drafts before j."""
        rows = torch.ones(len(drafts) + 1, self.vocab_size, dtype=torch.bool)
        consumed = 0
        for j in range(len(drafts) + 1):
            rows[j] = self._mask()
            if j == len(drafts) or not rows[j, drafts[j]] or not self._m.consume_token(drafts[j]):
                break
            consumed += 1
        if consumed:
            self._m.rollback(consumed)
        return rows

    def advance(self, tokens: list[int]) -> None:
        """Commit ``tokens`` (each one allowed by the mask it was chosen under)."""
        for token in tokens:
            if self._m.is_stopped():
                return
            if not self._m.consume_token(token):
                log.warning("committed token refused by the grammar", token=token, error=self._m.get_error())
                return
