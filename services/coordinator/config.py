"""Coordinator configuration: every field is a CLI flag and a SPECFLEET_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ConfigError, opt, section


@dataclass
class ServerSection:
    """serving: where the coordinator listens, how long requests may take"""

    host: str = opt("127.0.0.1", "interface to listen on (0.0.0.0 in containers)")
    port: int = opt(8000, "HTTP port (REST, SSE, WebSocket streaming, metrics)")
    node_id: str = opt("", "this coordinator's name, unique per process (the verifier drops queued requests of a "
                           "coordinator that is gone); empty picks coordinator-<hostname>-<pid>-<random>")
    log_level: str = opt("info", "debug, info, warning, error")
    request_timeout_s: float = opt(600.0, "fail a request that has not finished after this many seconds")
    drain_timeout_s: float = opt(
        30.0,
        "on SIGTERM (or Ctrl-C): answer new requests 503 and /ready 503, let in-flight requests finish for up to this "
        "many seconds, then exit 0; a second signal stops at once",
    )


@dataclass
class TargetSection:
    """the target: its tokenizer, its name, its verifier"""

    model: str = opt("", "local directory of the target model (tokenizer, chat template, /v1/models root)")
    served_model_name: str = opt("", "model id clients must ask for; empty uses the model directory's name")
    verifier_url: str = opt("ws://127.0.0.1:8100/v1/frontend",
                            "the verifier's frontend WebSocket endpoint; several replicas: a comma-separated list "
                            "(each request stays on one, and fails over to another when it is lost)")
    speculation: str = opt(
        "auto",
        "on: every request goes through the queue to a drafter; off: the verifier decodes target-only "
        "(centralized serving, no drafters needed); auto: like on while a drafter is connected and the verifier's "
        "draft-length policy wants drafts (--allocation smartspec turns them off while plain decoding is faster "
        "at the recent load), else off",
    )


@dataclass
class QueueSection:
    """the request queue"""

    redis_url: str = opt("", "redis://host:6379/0 to queue requests in Redis Streams; empty: in-process queue")
    queue_stream: str = opt("specfleet:requests", "Redis stream name")
    queue_group: str = opt("drafters", "Redis consumer group the drafters read with")
    stream_store: str = opt("", "where resumable streams are recorded (how each request was opened, whose key): "
                                "a file path: SQLite there, which outlives this coordinator; empty: in Redis with "
                                "--redis-url (every coordinator of the fleet can resume every stream), else in this "
                                "process only")
    queue_fallback_s: float = opt(
        5.0,
        "with --speculation auto: after this many seconds with no drafter connected, requests still waiting in "
        "the queue are served target-only (a drafter that comes back takes them over); 0: they wait for a drafter",
    )
    queue_wait_s: float = opt(
        0.5,
        "with --speculation auto: a request that no drafter has taken within this many seconds (every drafter "
        "busy) starts target-only, and a drafter that frees up takes it over from there; 0: it waits for a drafter",
    )


@dataclass
class SecuritySection:
    """security: the verifier link, the drafters' queue link, TLS"""

    auth_token: str = opt("", "bearer token for the verifier link and the drafters' queue link (with "
                              "--credentials-file: the verifier link only)")
    credentials_file: str = opt("", "per-drafter credentials for the queue link (the verifier's file format), re-read "
                                    "when it changes; a removed entry is revoked at once")
    tls_cert: str = opt("", "PEM certificate chain: serve HTTPS and wss:// on --port (REST, /v1/stream and the "
                            "drafters' queue link); with --tls-key")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt("", "PEM certificate authorities to trust for a wss:// --verifier-url (pinning: only these); "
                          "empty: the system store")


@dataclass
class ClientSection:
    """clients: API keys, rate limits and quotas"""

    api_key: str = opt("", "if set, clients must send 'Authorization: Bearer <api_key>'")
    api_keys: str = opt("", "more client API keys (comma-separated), each with its own rate limit and quota "
                                  "(with --api-key or alone: any listed key is accepted)")
    rate_limit_rps: float = opt(0.0, "requests per second each API key may send (a token bucket); over it: 429 "
                                     "with Retry-After; 0: no limit")
    rate_limit_burst: int = opt(0, "requests an API key may send at once before --rate-limit-rps applies; 0: "
                                   "max(1, ceil(rate))")
    token_quota: int = opt(0, "completion tokens (each request's max_tokens, charged on admission) an API key may "
                              "ask for per --quota-window-s; over it: 429 insufficient_quota; 0: no quota")
    quota_window_s: float = opt(3600.0, "the --token-quota window in seconds")


@dataclass
class AdmissionSection:
    """backpressure"""

    max_in_flight: int = opt(
        256,
        "most requests admitted at once (reading, queued or generating); further ones get 429 with "
        "Retry-After at once; 0: no limit",
    )
    max_queue: int = opt(
        1024,
        "most requests the in-process queue holds waiting for a drafter; a full queue answers 429 with "
        "Retry-After; 0: no limit (unused with --redis-url)",
    )
    retry_after_s: int = opt(1, "the Retry-After seconds sent with 429 (overload) and 503 (verifier busy) answers")


@dataclass
class CoordinatorConfig:
    """specfleet coordinator: the OpenAI-compatible front door and the request queue."""

    server: ServerSection = section(ServerSection)
    target: TargetSection = section(TargetSection)
    queue: QueueSection = section(QueueSection)
    security: SecuritySection = section(SecuritySection)
    clients: ClientSection = section(ClientSection)
    admission: AdmissionSection = section(AdmissionSection)


def check_config(cfg: CoordinatorConfig) -> None:
    """Raise ConfigError naming every out-of-range backpressure setting."""
    problems = [f"--{name.replace('_', '-')} must be >= 0 (0: no limit), got {value}"
                for name, value in (("max_in_flight", cfg.admission.max_in_flight),
                                    ("max_queue", cfg.admission.max_queue))
                if value < 0]
    if cfg.server.drain_timeout_s < 0:
        problems.append(f"--drain-timeout-s must be >= 0, got {cfg.server.drain_timeout_s}")
    if cfg.clients.rate_limit_rps < 0 or cfg.clients.rate_limit_burst < 0 or cfg.clients.token_quota < 0:
        problems.append("--rate-limit-rps, --rate-limit-burst and --token-quota must be >= 0 (0: off)")
    if cfg.clients.quota_window_s <= 0:
        problems.append(f"--quota-window-s must be > 0, got {cfg.clients.quota_window_s}")
    if cfg.queue.queue_fallback_s < 0:
        problems.append(f"--queue-fallback-s must be >= 0 (0: off), got {cfg.queue.queue_fallback_s}")
    if cfg.queue.queue_wait_s < 0:
        problems.append(f"--queue-wait-s must be >= 0 (0: off), got {cfg.queue.queue_wait_s}")
    if cfg.admission.retry_after_s < 1:
        problems.append(f"--retry-after-s must be >= 1, got {cfg.admission.retry_after_s}")
    if problems:
        raise ConfigError("; ".join(problems))
