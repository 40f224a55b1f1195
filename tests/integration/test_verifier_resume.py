"""A request re-opened on a restarted verifier from what its coordinator relayed (OpenSession.resume)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.verifier.detok import IncrementalText
from shared.protocol import (
    Draft,
    ErrorFrame,
    OpenSession,
    ResumeDone,
    ResumeState,
    SamplingParams,
    SessionOpened,
    Verdict,
    Welcome,
)
from tests.conftest import greedy_reference
from tests.integration.test_verifier import Running, collect_text, connect, serving

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def verifier(tiny_models: dict[str, Path]) -> AsyncIterator[Running]:
    """A verifier that holds drafters' opens until their coordinator said ResumeDone."""
    async with serving(tiny_models, draft_len=3, resume_grace_s=60.0) as running:
        yield running


def relayed(tokenizer: object, stops: list[str], ids: list[int]) -> str:
    """The text a first verifier had released for ``ids`` (some may still be held back)."""
    text = IncrementalText(tokenizer, stops)
    return "".join(text.release(final=text.push(token)) for token in ids)


async def test_a_resumed_request_goes_on_with_its_stop_string_and_usage(verifier: Running) -> None:
    tok = verifier.target.tokenizer
    prompt = [3, 50, 51, 52]
    ref = greedy_reference(verifier.target.model, prompt, 40, verifier.target.eos_ids)
    full = tok.decode(ref, skip_special_tokens=True)
    stop = full[10:13]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    expected = full[: full.index(stop)]
    async with connect(verifier.url, "frontend") as fe:
        await fe.recv(Welcome)
        for cut in range(1, 8):  # the stop string spans the resume point for some of these cuts
            sent = relayed(tok, [stop], ref[:cut])
            rid = f"r{cut}"
            await fe.send(OpenSession(request_id=rid, prompt_ids=prompt, params=params, origin="test-frontend",
                                      speculative=False, resume=ResumeState(generated_ids=ref[:cut],
                                                                            released_chars=len(sent),
                                                                            drafted_tokens=5, accepted_tokens=2)))
            ids, text, last = await collect_text(fe, rid)
            assert sent + text == expected, f"resumed after {cut} tokens"
            assert ref[:cut] + ids == ref[: cut + len(ids)] and last.finish_reason == "stop"
            assert last.prompt_tokens == len(prompt) and last.completion_tokens == cut + len(ids)
            assert last.drafted_tokens >= 5 and last.accepted_tokens >= 2


async def test_drafters_wait_for_resume_done_then_resume_the_reopened_session(verifier: Running) -> None:
    model, fp = verifier.target.model, verifier.target.fingerprint
    prompt = [3, 60, 61, 62, 63]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = greedy_reference(model, prompt, 24, verifier.target.eos_ids)
    async with connect(verifier.url, "drafter", fp) as peer, connect(verifier.url, "frontend") as fe:
        await peer.recv(Welcome)
        await fe.recv(Welcome)
        await peer.send(OpenSession(request_id="q", prompt_ids=prompt, params=params, origin="test-frontend"))
        held = await peer.recv(ErrorFrame, rid="q")
        assert held.code == "busy" and "re-opened" in held.message  # the coordinator may yet re-open it
        await fe.send(OpenSession(request_id="q", prompt_ids=prompt, params=params, origin="test-frontend",
                                  speculative=False, resume=ResumeState(generated_ids=ref[:6])))
        await fe.send(ResumeDone(sessions=1))
        await peer.send(OpenSession(request_id="q", prompt_ids=prompt, params=params, origin="test-frontend"))
        opened = await peer.recv(SessionOpened, ErrorFrame, rid="q")
        if isinstance(opened, SessionOpened):  # the verifier may also finish it target-only first
            assert opened.committed_ids == ref[: len(opened.committed_ids)] and len(opened.committed_ids) >= 6
            committed, rnd, budget = list(opened.committed_ids), opened.round, opened.draft_budget
            while True:
                base = len(committed)
                await peer.send(Draft(request_id="q", round=rnd, token_ids=ref[base : base + budget]))
                verdict = await peer.recv(Verdict, rid="q")
                committed += verdict.token_ids
                if verdict.finished:
                    break
                rnd, budget = rnd + 1, verdict.draft_budget
            assert committed == ref
        else:
            assert opened.code == "duplicate"
        ids, _, last = await collect_text(fe, "q")
        assert ref[:6] + ids == ref and last.completion_tokens == len(ref)
