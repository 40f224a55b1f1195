"""Every request field the OpenAI endpoints know, and what specfleet does with each.

No field is ever silently ignored: a body's fields are checked here, before anything else, and

* a field specfleet implements passes on to :mod:`services.coordinator.openai_api`;
* a field it does not implement yet is refused with a 400 naming it, *unless* the body sends
  that field's neutral value (``presence_penalty: 0``, ``n: 1``, ``logprobs: false``...), which
  asks for nothing: stock clients such as LangChain send those on every request;
* a field nobody knows is refused as OpenAI itself does ("Unrecognized request argument").

``services/coordinator/README.md`` has the same table for users; a test keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from services.coordinator.errors import ApiError, invalid_request

Kind = Literal["chat", "completion"]
Status = Literal["implemented", "accepted", "refused"]
BOTH: tuple[Kind, ...] = ("chat", "completion")
CHAT: tuple[Kind, ...] = ("chat",)
COMP: tuple[Kind, ...] = ("completion",)


@dataclass(frozen=True)
class Field:
    """One request field: which endpoints know it, its status, and (refused) which values ask
    for nothing and so pass."""

    kinds: tuple[Kind, ...]
    status: Status
    why: str = ""
    neutral: Callable[[Any], bool] = lambda v: v is None


def _is(*values: Any) -> Callable[[Any], bool]:
    """Neutral when the value is null or one of ``values`` (compared with its type: True != 1)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


_NOT_YET = "is not supported yet"
_NEVER = "is not supported"

FIELDS: dict[str, Field] = {
    # --- implemented ------------------------------------------------------------------------
    "model": Field(BOTH, "implemented"),
    "messages": Field(CHAT, "implemented"),
    "prompt": Field(COMP, "implemented"),
    "max_tokens": Field(BOTH, "implemented"),
    "max_completion_tokens": Field(CHAT, "implemented"),
    "temperature": Field(BOTH, "implemented"),
    "top_p": Field(BOTH, "implemented"),
    "top_k": Field(BOTH, "implemented"),
    "seed": Field(BOTH, "implemented"),
    "stop": Field(BOTH, "implemented"),
    "stop_token_ids": Field(BOTH, "implemented"),
    "ignore_eos": Field(BOTH, "implemented"),
    "n": Field(BOTH, "implemented"),
    "stream": Field(BOTH, "implemented"),
    "stream_options": Field(BOTH, "implemented"),  # its own fields: STREAM_OPTIONS
    "slo_tokens_per_s": Field(BOTH, "implemented"),
    # --- accepted: they change nothing about the output, by their definition ----------------
    "user": Field(BOTH, "accepted", "an end-user id for abuse monitoring; it does not change the output"),
    "safety_identifier": Field(CHAT, "accepted", "like user"),
    "metadata": Field(CHAT, "accepted", "tags for stored completions; specfleet stores nothing"),
    "store": Field(CHAT, "refused", "storing completions " + _NEVER, _is(False)),
    "service_tier": Field(CHAT, "refused", "only 'auto' and 'default' service tiers exist here",
                          _is("auto", "default")),
    "parallel_tool_calls": Field(CHAT, "accepted", "has no effect without tools"),
    "prompt_cache_key": Field(CHAT, "accepted", "a caching hint; it cannot change the output"),
    # --- not yet: refused unless neutral ----------------------------------------------------
    "logprobs": Field(BOTH, "implemented"),
    "top_logprobs": Field(CHAT, "implemented"),
    "logprobs_mode": Field(BOTH, "implemented"),
    "prompt_logprobs": Field(BOTH, "refused", "prompt_logprobs " + _NOT_YET),
    "echo": Field(BOTH, "implemented"),
    "presence_penalty": Field(BOTH, "implemented"),
    "frequency_penalty": Field(BOTH, "implemented"),
    "repetition_penalty": Field(BOTH, "implemented"),
    "logit_bias": Field(BOTH, "implemented"),
    "best_of": Field(COMP, "refused", "best_of " + _NEVER + " (use n)", _is(1)),
    "response_format": Field(BOTH, "implemented"),
    "guided_json": Field(BOTH, "implemented"),
    "guided_regex": Field(BOTH, "implemented"),
    "guided_choice": Field(BOTH, "implemented"),
    "guided_grammar": Field(BOTH, "refused", "guided_grammar " + _NOT_YET),
    "guided_decoding_backend": Field(BOTH, "refused", "guided decoding " + _NOT_YET),
    "guided_whitespace_pattern": Field(BOTH, "refused", "guided decoding " + _NOT_YET),
    "structured_outputs": Field(BOTH, "refused", "structured_outputs " + _NOT_YET),
    "structural_tag": Field(BOTH, "refused", "structural_tag " + _NOT_YET),
    "min_p": Field(BOTH, "refused", "min_p " + _NOT_YET, _is(0, 0.0)),
    "min_tokens": Field(BOTH, "refused", "min_tokens " + _NOT_YET, _is(0)),
    "include_stop_str_in_output": Field(BOTH, "refused", "include_stop_str_in_output " + _NOT_YET, _is(False)),
    "allowed_token_ids": Field(BOTH, "refused", "allowed_token_ids " + _NOT_YET),
    "bad_words": Field(BOTH, "refused", "bad_words " + _NOT_YET, _empty),
    "return_tokens_as_token_ids": Field(BOTH, "refused", "return_tokens_as_token_ids " + _NOT_YET, _is(False)),
    "return_token_ids": Field(BOTH, "refused", "return_token_ids " + _NOT_YET, _is(False)),
    "truncate_prompt_tokens": Field(BOTH, "refused", "truncate_prompt_tokens " + _NOT_YET),
    # --- refused: specfleet does not do these -----------------------------------------------
    "tools": Field(CHAT, "refused", "tool calling (tools) " + _NEVER, _empty),
    "tool_choice": Field(CHAT, "refused", "tool calling (tool_choice) " + _NEVER, _is("none")),
    "functions": Field(CHAT, "refused", "function calling (functions) " + _NEVER, _empty),
    "function_call": Field(CHAT, "refused", "function calling (function_call) " + _NEVER, _is("none")),
    "suffix": Field(COMP, "refused", "suffix (fill-in-the-middle) " + _NEVER),
    "audio": Field(CHAT, "refused", "audio output " + _NEVER),
    "modalities": Field(CHAT, "refused", "only text output is supported", lambda v: v is None or v == ["text"]),
    "prediction": Field(CHAT, "refused", "predicted outputs (prediction) " + _NEVER),
    "reasoning_effort": Field(CHAT, "refused", "reasoning_effort " + _NEVER),
    "verbosity": Field(CHAT, "refused", "verbosity " + _NEVER),
    "web_search_options": Field(CHAT, "refused", "web search " + _NEVER),
    "use_beam_search": Field(BOTH, "refused", "beam search " + _NEVER, _is(False)),
    "length_penalty": Field(BOTH, "refused", "length_penalty (beam search) " + _NEVER, _is(1, 1.0)),
    "skip_special_tokens": Field(BOTH, "refused", "special tokens are always skipped in text", _is(True)),
    "spaces_between_special_tokens": Field(BOTH, "refused", "spaces_between_special_tokens " + _NEVER, _is(True)),
    "add_generation_prompt": Field(CHAT, "refused", "the chat template always adds the generation prompt",
                                   _is(True)),
    "continue_final_message": Field(CHAT, "refused", "continue_final_message " + _NEVER, _is(False)),
    "add_special_tokens": Field(BOTH, "refused", "add_special_tokens " + _NEVER),
    "documents": Field(CHAT, "refused", "documents " + _NEVER),
    "chat_template": Field(CHAT, "refused", "a per-request chat_template " + _NEVER),
    "chat_template_kwargs": Field(CHAT, "refused", "chat_template_kwargs " + _NEVER, _empty),
    "mm_processor_kwargs": Field(CHAT, "refused", "mm_processor_kwargs " + _NEVER, _empty),
    "logits_processors": Field(BOTH, "refused", "logits_processors " + _NEVER, _empty),
    "priority": Field(BOTH, "refused", "priority " + _NEVER + " (see slo_tokens_per_s)", _is(0)),
    "request_id": Field(BOTH, "refused", "a client-chosen request_id " + _NEVER),
    "cache_salt": Field(BOTH, "refused", "cache_salt " + _NEVER),
    "kv_transfer_params": Field(BOTH, "refused", "kv_transfer_params " + _NEVER),
    "vllm_xargs": Field(BOTH, "refused", "vllm_xargs " + _NEVER, _empty),
}

#: the fields of ``stream_options``
STREAM_OPTIONS: dict[str, Field] = {
    "include_usage": Field(BOTH, "implemented"),
    "continuous_usage_stats": Field(BOTH, "implemented"),
}


def check_fields(kind: Kind, body: dict[str, Any]) -> None:
    """Raise a 400 naming the first field of ``body`` that specfleet would otherwise ignore."""
    _check(kind, body, FIELDS, "")
    options = body.get("stream_options")
    if isinstance(options, dict):
        _check(kind, options, STREAM_OPTIONS, "stream_options.")


def _check(kind: Kind, body: dict[str, Any], table: dict[str, Field], prefix: str) -> None:
    for name, value in body.items():
        field = table.get(name)
        if field is None or kind not in field.kinds:
            raise _unknown(kind, prefix + name, field is not None)
        if field.status == "refused" and not field.neutral(value):
            raise invalid_request(
                f"{field.why}; remove '{prefix + name}' from the request "
                f"(services/coordinator/README.md lists every field and its status)",
                prefix + name, "unsupported_parameter")


def _unknown(kind: Kind, name: str, other_endpoint: bool) -> ApiError:
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    where = f"; it belongs to the other endpoint, not {endpoint}" if other_endpoint else ""
    return invalid_request(f"Unrecognized request argument supplied: {name}{where}", name, "unsupported_parameter")
