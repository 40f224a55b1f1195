"""A real redis-server for the test session (imported by tests/conftest.py).

``redis_url`` starts ``redis-server`` on a free loopback port with persistence off, in a
temporary directory (``shared.redis_server``), and stops it when the session ends. Tests
share it, so each test uses its own stream name. Without the binary the tests skip, or fail
when ``CI=true`` (CI must not silently lose the Redis coverage); ``scripts/ensure-redis.sh``
installs it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from shared.redis_server import MISSING, start_redis, stop_redis

__all__ = ["redis_url"]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis://127.0.0.1:<port>/0`` of a redis-server private to this test session."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    try:
        proc, port = start_redis(tmp_path_factory.mktemp("redis"))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis(proc)
