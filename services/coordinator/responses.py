"""OpenAI response objects and stream chunks, built from the verifier's TokenEvents.

Shapes follow OpenAI (and vLLM) so stock clients parse them: ``chat.completion`` /
``text_completion`` bodies, ``chat.completion.chunk`` / ``text_completion`` stream chunks where
the first chat chunk carries ``delta.role`` and the last carries ``finish_reason``, and an
optional usage-only chunk at the end. Each non-streaming body also carries a ``specfleet``
object with the request's drafted and accepted token counts (an extension; clients ignore it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.coordinator.generation import Collected
from services.coordinator.logprobs import LogprobsFormatter
from services.coordinator.openai_api import Kind, ResponseMode
from shared.protocol import TokenEvent, TokenLogprob


def usage(*finals: TokenEvent) -> dict[str, int]:
    """Usage of one or several choices of the same request: the prompt counts once."""
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation(*finals: TokenEvent) -> dict[str, int]:
    return {"drafted_tokens": sum(f.drafted_tokens for f in finals),
            "accepted_tokens": sum(f.accepted_tokens for f in finals)}


def finish_reason(final: TokenEvent) -> str:
    """OpenAI knows only "stop" and "length"; anything else never reaches a success body."""
    return "length" if final.finish_reason == "length" else "stop"


@dataclass(frozen=True)
class Responder:
    """Builds every body of one request; ids and timestamps stay identical across chunks."""

    kind: Kind
    request_id: str
    model: str
    created: int
    mode: ResponseMode = field(default_factory=ResponseMode)  # where the usage goes
    #: set when the request asked for logprobs
    logprobs: LogprobsFormatter | None = None
    echo: str = ""  # the text each choice starts with (``echo``)
    prompt_tokens: int = 0

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprob] | None,
                  index: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if logprobs is None or len(logprobs) != len(token_ids):
            raise ValueError("the verifier sent no logprobs for a request that asked for them")
        return self.logprobs.format(token_ids, logprobs, index)

    def full(self, choices: list[Collected]) -> dict[str, Any]:
        """The non-streaming response: one choice per Collected, in order."""
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        body.update(choices=[self._choice(i, done) for i, done in enumerate(choices)],
                    usage=usage(*(c.final for c in choices)), specfleet=speculation(*(c.final for c in choices)))
        return body

    def _choice(self, index: int, done: Collected) -> dict[str, Any]:
        text = self.echo + done.text
        logprobs = self._logprobs(done.token_ids, done.logprobs, index)
        if self.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason(done.final)}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(done.final)}

    def chunk(self, text: str, reason: str | None = None, first: bool = False,
              event: TokenEvent | None = None, generated: int = 0, index: int = 0) -> dict[str, Any]:
        """One stream chunk adding ``text`` to choice ``index`` (and the logprobs of ``event``'s
        tokens, when asked); ``first`` opens the chat message with its role; ``generated``: tokens
        so far over all choices, for continuous usage."""
        logprobs = self._logprobs(event.token_ids, event.logprobs, index) if event is not None else None
        if self.kind == "chat":
            out = self._head("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            out = self._head("text_completion")
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        out["choices"] = [choice]
        if self.mode.continuous_usage:
            out["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated,
                            "total_tokens": self.prompt_tokens + generated}
        elif self.mode.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, *finals: TokenEvent) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, only usage."""
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage(*finals))
        return out
