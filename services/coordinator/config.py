"""Coordinator configuration: every field is a CLI flag and a SPECFLEET_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class CoordinatorConfig:
    """specfleet coordinator: the OpenAI-compatible front door and the request queue."""

    host: str = opt("127.0.0.1", "interface to listen on (0.0.0.0 in containers)")
    port: int = opt(8000, "HTTP port (REST, SSE, WebSocket streaming, metrics)")
    verifier_url: str = opt("ws://127.0.0.1:8100/v1/frontend", "the verifier's frontend WebSocket endpoint")
    redis_url: str = opt("", "redis://host:6379/0 to queue requests in Redis Streams; empty: in-process queue")
    queue_stream: str = opt("specfleet:requests", "Redis stream name")
    queue_group: str = opt("drafters", "Redis consumer group the drafters read with")
    speculation: str = opt(
        "auto",
        "on: every request goes through the queue to a drafter; off: the verifier decodes target-only "
        "(centralized serving, no drafters needed); auto: like on while a drafter is connected, else off",
    )
    model: str = opt("", "local directory of the target model (tokenizer, chat template, /v1/models root)")
    served_model_name: str = opt("", "model id clients must ask for; empty uses the model directory's name")
    auth_token: str = opt("", "bearer token for the verifier link and the drafters' queue link")
    api_key: str = opt("", "if set, clients must send 'Authorization: Bearer <api_key>'")
    request_timeout_s: float = opt(600.0, "fail a request that has not finished after this many seconds")
    node_id: str = opt("", "this coordinator's name; empty picks coordinator-<hostname>-<pid>")
    log_level: str = opt("info", "debug, info, warning, error")
