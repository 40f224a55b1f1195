"""The coordinator's record of what it relayed, from which a restarted verifier re-opens requests."""

from __future__ import annotations

from services.coordinator.resume import ResumeLedger
from shared.protocol import OpenSession, ResumeState, SamplingParams, TokenEvent

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, stop=["\n\n"])


def opened(rid: str) -> OpenSession:
    return OpenSession(request_id=rid, prompt_ids=[1, 2, 3], params=PARAMS, origin="c1", speculative=False,
                       slo_tokens_per_s=50.0)


def event(rid: str, ids: list[int], text: str, finished: bool = False, drafted: int = 0,
          accepted: int = 0) -> TokenEvent:
    return TokenEvent(request_id=rid, origin="c1", token_ids=ids, text=text, finished=finished,
                      drafted_tokens=drafted, accepted_tokens=accepted)


def test_reopen_carries_everything_relayed_and_the_original_request() -> None:
    ledger = ResumeLedger()
    ledger.track(opened("a"))
    ledger.track(opened("b"))
    ledger.relayed(event("a", [7, 8], "ab", drafted=4, accepted=2))
    ledger.relayed(event("a", [9], "", drafted=6, accepted=3))  # text held back for a stop string
    ledger.relayed(event("zzz", [1], "x"))  # not tracked: ignored
    frames = {f.request_id: f for f in ledger.reopen()}
    assert set(frames) == {"a", "b"}
    a = frames["a"]
    assert a.resume == ResumeState(generated_ids=[7, 8, 9], released_chars=2, drafted_tokens=6, accepted_tokens=3)
    assert (a.prompt_ids, a.params, a.origin, a.speculative, a.slo_tokens_per_s) == ([1, 2, 3], PARAMS, "c1",
                                                                                     False, 50.0)
    assert frames["b"].resume == ResumeState(generated_ids=[])


def test_finished_or_forgotten_requests_are_not_reopened() -> None:
    ledger = ResumeLedger()
    for rid in ("done", "gone", "live"):
        ledger.track(opened(rid))
    ledger.relayed(event("done", [5], "x", finished=True))
    ledger.forget("gone")
    assert [f.request_id for f in ledger.reopen()] == ["live"]
    assert "done" not in ledger and len(ledger) == 1
    ledger.clear()
    assert ledger.reopen() == []


def test_a_reopened_request_keeps_its_slo_clock() -> None:
    """The re-open says how long ago this coordinator took the request (OpenSession.waited_s), so
    the restarted verifier counts its SLO from then, not from the re-open."""
    ledger = ResumeLedger()
    ledger.track(opened("a"))
    ledger._entries["a"].taken_at -= 12.0  # taken 12 s ago
    (frame,) = ledger.reopen()
    assert 12.0 <= frame.waited_s < 14.0
