"""What the coordinator knows about the target model: its tokenizer, context length and names.

The coordinator tokenizes prompts itself (so drafters and the verifier receive token ids), but it
never runs the model: it loads only the tokenizer and ``config.json``, which takes a fraction of
a second and no memory worth mentioning, even for a 70B target.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.coordinator.errors import invalid_request
from shared.models import ModelLoadError, load_tokenizer, tokenizer_fingerprint

_FALLBACK_CONTEXT = 2048


@dataclass
class ModelInfo:
    served_name: str
    root: str  # absolute path of the target model directory
    max_model_len: int  # from config.json's max_position_embeddings
    tokenizer: Any
    fingerprint: str
    vocab_size: int
    created: int = field(init=False, default_factory=lambda: int(time.time()))
    # HF fast tokenizers are not safe to call from several threads at once.
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)
    _token_text: dict[int, str] = field(init=False, default_factory=dict, repr=False)

    @classmethod
    def load(cls, path: str, served_name: str = "") -> ModelInfo:
        """Load the tokenizer and context length of the model directory ``path``."""
        if not path:
            raise ModelLoadError(
                "no target model configured: pass --model (or SPECFLEET_MODEL) with the local directory "
                "of the verifier's target model; the coordinator needs its tokenizer and chat template"
            )
        directory = Path(path).resolve()
        tokenizer = load_tokenizer(directory)
        return cls(
            served_name=served_name or directory.name,
            root=str(directory),
            max_model_len=_context_length(directory),
            tokenizer=tokenizer,
            fingerprint=tokenizer_fingerprint(tokenizer),
            vocab_size=len(tokenizer),
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the chat template with the assistant turn opened, and tokenize it."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid_request(
                f"the model '{self.served_name}' has no chat template; use /v1/completions with a plain prompt",
                "messages",
            )
        try:
            with self._lock:
                out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja2 TemplateError, ValueError, ...: the messages do not fit the template
            raise invalid_request(f"the messages do not fit the model's chat template: {exc}", "messages") from None
        return _ids(out)

    def encode_text(self, text: str) -> list[int]:
        with self._lock:
            return _ids(self.tokenizer(text))

    def decode_text(self, ids: list[int]) -> str:
        """Token ids as text (special tokens kept), e.g. a prompt sent as ids, for ``echo``."""
        with self._lock:
            return str(self.tokenizer.decode(ids))

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included), as logprobs responses name tokens.

        A token that is only part of a UTF-8 character decodes to U+FFFD on its own; it is named
        by its vocabulary entry instead, so distinct tokens keep distinct names (completions'
        ``top_logprobs`` are keyed by name).
        """
        missing = [i for i in ids if i not in self._token_text]
        if missing:
            with self._lock:
                for i in missing:
                    text = self.tokenizer.decode([i])
                    self._token_text[i] = self.tokenizer.convert_ids_to_tokens(i) if "\ufffd" in text else text
        return [self._token_text[i] for i in ids]

    def check_ids(self, ids: list[int], param: str) -> None:
        """A prompt given as token ids must stay inside the vocabulary."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise invalid_request(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size - 1}]", param
            )


def _ids(out: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding (dict-like); older versions a plain list."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):  # batched form: one sequence
        out = out[0]
    return [int(i) for i in out]


def _context_length(directory: Path) -> int:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read config.json of {directory}: {exc}") from None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    text_config = getattr(config, "text_config", None)
    value = getattr(text_config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else _FALLBACK_CONTEXT
