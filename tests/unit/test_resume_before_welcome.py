"""A resume at a coordinator that no verifier has welcomed yet (one just restarted) waits for the
welcome instead of calling its stream unknown; with no verifier at all it gets a 503 to retry.

Seen in `make test` (2026-12-06, Xeon VM): a client whose coordinator was killed resumed at the
restarted one before its verifier link was up, and was told "no stream ... to resume"; the record
was in the state dir's store all along."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services.coordinator import resumption
from services.coordinator.errors import ApiError
from services.coordinator.resumption import Resumes
from services.coordinator.stream_store import MemoryStreamStore, StreamRecord, key_hash

CLIENT = "Bearer k"


class Link(SimpleNamespace):
    """The verifier link as Resumes reads it: the Welcome (None until one came), its grace, and the wait for it."""

    @property
    def welcomed(self) -> bool:
        return self.welcome is not None

    @property
    def grace_s(self) -> float:
        return 0.0 if self.welcome is None else self.welcome.orphan_grace_s

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once welcomed, False after ``timeout_s`` (as the real link's)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self.welcomed:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            return False
        return True


async def resume_when_welcomed_after(delay_s: float | None) -> tuple[float, ApiError]:
    """Resume a recorded (non-streamed) request; the link is welcomed after ``delay_s`` (None: never).
    Returns how long the answer took and the error it was (a record not streamed: not_a_stream)."""
    store, link = MemoryStreamStore(), Link(welcome=None)
    record = StreamRecord(request_id="r1", key=key_hash(CLIENT), kind="completion", model="m", created=0, opened=[],
                          owner="c1", stream=False)
    await store.put(record, 60.0)
    resumes = Resumes(store, generator=Any, link=link, node_id="c2", timeout_s=60.0)  # type: ignore[arg-type]

    async def welcome() -> None:
        if delay_s is not None:
            await asyncio.sleep(delay_s)
            link.welcome = SimpleNamespace(orphan_grace_s=30.0)

    task = asyncio.create_task(welcome())
    began = asyncio.get_running_loop().time()
    with pytest.raises(ApiError) as caught:
        await resumes.from_position(None, CLIENT, "r1", [0])
    await task
    return asyncio.get_running_loop().time() - began, caught.value


def test_a_resume_before_the_welcome_waits_for_it() -> None:
    took, error = asyncio.run(resume_when_welcomed_after(0.3))
    assert error.code == "not_a_stream", error.message  # the record was found: the stream is known
    assert took >= 0.3


def test_a_resume_with_no_verifier_gets_a_503_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resumption, "WELCOME_WAIT_S", 0.2)
    took, error = asyncio.run(resume_when_welcomed_after(None))
    assert error.status == 503 and "retry" in error.message
    assert took >= 0.2
