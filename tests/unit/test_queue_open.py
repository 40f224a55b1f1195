"""open_queue picks the transport from the URL scheme; Redis URLs are redacted in messages."""

from __future__ import annotations

import pytest

from shared.queue import QueueError, open_queue
from shared.queue_link import QueueLinkClient
from shared.queue_memory import MemoryQueue
from shared.queue_redis import RedisStreamQueue, redact_url


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("memory://", MemoryQueue),
        ("redis://127.0.0.1:6379/0", RedisStreamQueue),
        ("rediss://user:pw@redis.example:6380/1", RedisStreamQueue),
        ("unix:///run/redis.sock", RedisStreamQueue),
        ("ws://127.0.0.1:8000/internal/queue", QueueLinkClient),
        ("WSS://coordinator:443/internal/queue", QueueLinkClient),
    ],
)
def test_scheme_picks_the_transport(url: str, cls: type) -> None:
    assert isinstance(open_queue(url, auth_token="t", claim_idle_ms=100), cls)


@pytest.mark.parametrize("url", ["", "localhost:6379", "http://coordinator:8000", "amqp://broker"])
def test_unsupported_url_names_the_options(url: str) -> None:
    with pytest.raises(QueueError, match=r"unsupported queue URL.*redis://.*ws://.*memory://"):
        open_queue(url)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://alice:pw@h/2", "rediss://alice:***@h/2"),
    ],
)
def test_redact_url_hides_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_bad_redis_url_is_a_queue_error() -> None:
    with pytest.raises(QueueError, match="bad Redis URL redis://h:abc/0"):
        open_queue("redis://h:abc/0")


def test_bad_claim_idle_is_rejected() -> None:
    with pytest.raises(ValueError, match="claim_idle_ms"):
        RedisStreamQueue("redis://127.0.0.1:6379/0", claim_idle_ms=0)
