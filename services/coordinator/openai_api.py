"""The OpenAI request bodies: parsing them into one typed internal request, and nothing else.

Both ``/v1/chat/completions`` and ``/v1/completions`` (and the WebSocket stream, which takes the
same bodies) end up as a :class:`GenerationRequest`: token ids plus validated SamplingParams.
Every way a body can be wrong becomes a 400 in the OpenAI error shape naming the offending
``param``, checked here, before anything is queued. No field is silently ignored: every body
first passes :func:`services.coordinator.fields.check_fields`, which refuses fields specfleet
does not implement (unless sent with their neutral value) and fields nobody knows.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar, cast

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.coordinator.errors import invalid_request, model_not_found
from services.coordinator.fields import Kind, check_fields
from services.coordinator.model_info import ModelInfo
from services.coordinator.structured import structured
from shared.protocol import MAX_LOGPROBS, SamplingParams, Structured
from shared.sampling import SamplingError, validate

B = TypeVar("B", bound="_CommonBody")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16  # shared.protocol.SamplingParams bounds
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16  # most choices one request may ask for
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # extension (vLLM): usage on every chunk


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None


class _CommonBody(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 disable it
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension (vLLM)
    echo: bool | None = False  # completions: OpenAI; chat: extension (vLLM)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # extension (vLLM), as the three below
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    #: extension (specfleet): the request's SLO class, a token-speed target the verifier's WISP
    #: batching schedules against (``--batching wisp``); None: the verifier's default class
    slo_tokens_per_s: float | None = Field(default=None, gt=0.0, le=10_000.0)
    #: extension (specfleet; vLLM has it as a server flag): which distribution logprobs come from
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None


class ChatBody(_CommonBody):
    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class CompletionBody(_CommonBody):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


@dataclass(frozen=True)
class ResponseMode:
    """How the response goes out: streamed or whole, and where streamed chunks carry the usage."""

    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, ready to queue."""

    kind: Kind
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    mode: ResponseMode = field(default_factory=ResponseMode)
    slo_tokens_per_s: float | None = None
    #: text the response starts with before the generated text (``echo``): the prompt, or for
    #: chat the last message's content when it is the assistant's (as vLLM)
    echo: str = ""
    n: int = 1  # choices: independent sessions (see choice)

    def choice(self, index: int) -> GenerationRequest:
        """The request of choice ``index``: choice i of a seeded request uses seed + i (as vLLM),
        so the choices differ and the whole response is reproducible."""
        seed = self.params.seed
        if index == 0 or seed is None:
            return self
        return replace(self, params=msgspec.structs.replace(self.params, seed=seed + index))


async def given(body: dict[str, Any]) -> dict[str, Any]:
    """A body read already, as the loader ``CoordinatorState.start`` takes."""
    return body


def parse_json(raw: bytes | str) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why it is not one."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise invalid_request("the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_request(f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def _validated(cls: type[B], data: dict[str, Any]) -> B:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        param = loc[0] if loc else None
        raise invalid_request(f"invalid value for '{'.'.join(loc[:1] + loc[2:]) or 'body'}': {first['msg']}",
                              param) from None


async def build_request(kind: Kind, data: dict[str, Any], model: ModelInfo, max_model_len: int) -> GenerationRequest:
    """Validate an OpenAI body of the given kind and tokenize its prompt."""
    body: _CommonBody
    check_fields(kind, data)
    if kind == "chat":
        chat = _validated(ChatBody, data)
        _check_common(chat, model)
        messages = _chat_messages(chat.messages)
        prompt_ids = await asyncio.to_thread(model.encode_chat, messages)
        echo = messages[-1]["content"] if chat.echo and messages[-1]["role"] == "assistant" else ""
        max_tokens = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
        prompt_param, body = "messages", chat
    else:
        comp = _validated(CompletionBody, data)
        _check_common(comp, model)
        prompt_ids = await _completion_ids(comp.prompt, model)
        echo = await _echo_prompt(comp, prompt_ids, model) if comp.echo else ""
        max_tokens = comp.max_tokens
        prompt_param, body = "prompt", comp
    if not prompt_ids:
        raise invalid_request(f"the {prompt_param} tokenized to zero tokens; send some text", prompt_param)
    if max_tokens is None:
        remaining = max(1, max_model_len - len(prompt_ids))
        max_tokens = remaining if kind == "chat" else min(COMPLETION_DEFAULT_MAX_TOKENS, remaining)
    params = _sampling_params(body, max_tokens, model)
    try:
        validate(params, len(prompt_ids), max_model_len)
    except SamplingError as exc:
        raise invalid_request(str(exc), prompt_param if exc.param in ("messages", "prompt") else exc.param) from None
    options = body.stream_options if body.stream else None
    mode = ResponseMode(bool(body.stream), bool(options and options.include_usage),
                           bool(options and options.continuous_usage_stats))
    return GenerationRequest(kind, model.served_name, prompt_ids, params, mode, body.slo_tokens_per_s, echo,
                             body.n or 1)


async def _echo_prompt(body: CompletionBody, prompt_ids: list[int], model: ModelInfo) -> str:
    """The prompt as text, for ``echo``: as sent, or decoded when it was sent as token ids."""
    if body.logprobs is not None:
        raise invalid_request("echo together with logprobs needs the prompt's logprobs, which are not supported "
                              "yet; drop echo or logprobs", "echo")
    prompt = body.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return await asyncio.to_thread(model.decode_text, prompt_ids)


def _check_common(body: _CommonBody, model: ModelInfo) -> None:
    if body.model is not None and body.model != model.served_name:
        raise model_not_found(body.model, model.served_name)
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise invalid_request(f"n must be in [1, {MAX_N}], got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise invalid_request("stream_options is only allowed together with stream=true", "stream_options")


def _chat_messages(messages: list[ChatMessage] | None) -> list[dict[str, str]]:
    if not messages:
        raise invalid_request("'messages' is required and must hold at least one message", "messages")
    out = []
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise invalid_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {msg.role!r}",
                                  "messages")
        out.append({"role": msg.role, "content": _content_text(msg.content, i)})
    return out


def _content_text(content: str | list[ContentPart] | None, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise invalid_request(f"messages[{index}].content is required", "messages")
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid_request(
                f"messages[{index}].content: only text parts are supported, got type {part.type!r}", "messages"
            )
        texts.append(part.text)
    return "".join(texts)


async def _completion_ids(prompt: str | list[str] | list[int] | list[list[int]] | None, model: ModelInfo) -> list[int]:
    """A prompt is a string, a list of one string, or token ids (a list of ints, or a list of one)."""
    if prompt is None or prompt == "" or prompt == []:
        raise invalid_request("'prompt' is required and must not be empty", "prompt")
    if isinstance(prompt, str):
        return await asyncio.to_thread(model.encode_text, prompt)
    if len(prompt) != 1 and not isinstance(prompt[0], int):
        raise invalid_request(f"batched prompts are not supported: send one prompt, not {len(prompt)}", "prompt")
    first = prompt[0]
    if isinstance(first, str):
        if not first:
            raise invalid_request("'prompt' must not be empty", "prompt")
        return await asyncio.to_thread(model.encode_text, first)
    ids = cast(list[int], prompt) if isinstance(first, int) else list(first)
    model.check_ids(ids, "prompt")
    return ids


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise invalid_request(f"at most {MAX_STOP} stop sequences are supported, got {len(stops)}", "stop")
    for s in stops:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise invalid_request(f"each stop sequence must be 1 to {MAX_STOP_CHARS} characters long", "stop")
    return stops


def _stop_ids(ids: list[int] | None, model: ModelInfo) -> list[int]:
    ids = list(ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported", "stop_token_ids")
    model.check_ids(ids, "stop_token_ids")
    return ids


def _structured(body: _CommonBody) -> Structured | None:
    spec = structured(body.response_format, body.guided_json, body.guided_regex, body.guided_choice)
    if spec is not None and body.ignore_eos:
        raise invalid_request("ignore_eos cannot be combined with structured output: the grammar ends the text",
                              "ignore_eos")
    return spec


def _logit_bias(bias: dict[str, float] | None, model: ModelInfo) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    model.check_ids(list(out), "logit_bias")
    return out


def _logprobs(body: _CommonBody) -> int | None:
    """How many alternatives to return logprobs for (None: no logprobs at all)."""
    if isinstance(body, ChatBody):
        if body.top_logprobs and not body.logprobs:
            raise invalid_request("top_logprobs needs logprobs=true", "top_logprobs")
        n = (body.top_logprobs or 0) if body.logprobs else None
    else:
        n = cast(CompletionBody, body).logprobs
    if body.logprobs_mode is not None and n is None:
        raise invalid_request("logprobs_mode only applies together with logprobs", "logprobs_mode")
    return n


def _sampling_params(body: _CommonBody, max_tokens: int, model: ModelInfo) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None else 0
    if top_k == -1 or top_k >= model.vocab_size:  # -1 is vLLM's "disabled"; >= vocab keeps everything
        top_k = 0
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=_stop_strings(body.stop),
        stop_token_ids=_stop_ids(body.stop_token_ids, model),
        ignore_eos=bool(body.ignore_eos),
        logprobs=_logprobs(body),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias, model),
        structured=_structured(body),
        logprobs_mode="processed" if body.logprobs_mode == "processed_logprobs" else "raw",
    )
