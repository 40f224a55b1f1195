"""shared.log: the JSON lines go to the stderr of the moment, never to a closed one."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from shared.log import get_logger, setup_logging


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    """The root logger, its handlers and level restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_records_follow_a_replaced_stderr(root_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging("test", "info")
    get_logger("test.log").info("one", n=1)
    monkeypatch.setattr(sys, "stderr", second)
    first.close()  # as a test's capture is closed when the test ends
    get_logger("test.log").warning("two", token="Bearer abc")
    line = json.loads(second.getvalue())
    assert line["msg"] == "two" and line["service"] == "test" and line["token"] == "Bearer ***"
