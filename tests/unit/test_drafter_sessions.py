"""Drafter bookkeeping: per-session state, draft-length caps, config checks."""

from __future__ import annotations

import time

import pytest
import torch

from services.drafter.config import DrafterConfig
from services.drafter.control.fixed import FixedController
from services.drafter.main import check_config, default_node_id
from services.drafter.sessions import DraftSession
from shared.config import ConfigError, from_flags, load_config
from shared.protocol import QueuedRequest, SamplingParams, Verdict
from shared.queue import Delivery
from shared.sampling import make_generator


def session(max_tokens: int = 10, seed: int | None = 4) -> DraftSession:
    req = QueuedRequest(request_id="r", prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens, seed=seed),
                        origin="c", model="m", created_at=time.time())
    return DraftSession.from_delivery(Delivery("7", req), FixedController())


def verdict(tokens: list[int], accepted: int, finished: bool = False, budget: int = 4) -> Verdict:
    return Verdict(request_id="r", round=0, accepted=accepted, token_ids=tokens, finished=finished,
                   finish_reason="length" if finished else None, draft_budget=budget)


@pytest.mark.parametrize(("max_tokens", "generated", "budget", "expected"), [
    (10, 0, 4, 4),  # plenty left: the whole budget
    (10, 7, 4, 2),  # 3 left: 2 drafts + the verifier's own token
    (10, 9, 4, 0),  # 1 left: the verifier's token alone ends it, an empty draft
    (10, 0, 0, 0),  # the verifier asked for none
])
def test_useful_draft_len(max_tokens: int, generated: int, budget: int, expected: int) -> None:
    s = session(max_tokens)
    s.committed.extend([5] * generated)
    assert s.useful_draft_len(budget) == expected


def test_apply_verdict_tracks_committed_tokens_and_stats() -> None:
    s = session()
    assert s.apply_verdict(verdict([8, 9, 10], accepted=2, budget=5), drafted=3) == [8, 9, 10]
    assert (s.committed, s.round, s.budget, s.finish_reason) == ([1, 2, 3, 8, 9, 10], 1, 5, None)
    s.apply_verdict(verdict([11], accepted=0, finished=True), drafted=2)
    assert s.finish_reason == "length" and s.generated == 4
    assert (s.stats.rounds, s.stats.drafted, s.stats.accepted) == (2, 5, 2)
    summary = s.summary()
    assert summary["acceptance_rate"] == 0.4 and summary["request_id"] == "r"


def test_seeded_sessions_draw_the_same_randomness() -> None:
    a, b = session(seed=4), session(seed=4)
    assert torch.rand(3, generator=a.rng).tolist() == torch.rand(3, generator=b.rng).tolist()


def test_a_session_drafts_from_the_draft_stream_not_the_verifiers() -> None:
    s = session(seed=4)
    assert s.rng.initial_seed() == make_generator(4, "draft").initial_seed()
    assert s.rng.initial_seed() != make_generator(4, "verify").initial_seed()
    assert session(seed=None).rng.initial_seed() != session(seed=None).rng.initial_seed()  # fresh entropy


def test_config_flags_and_checks() -> None:
    cfg = load_config(DrafterConfig, ["--model", "/m", "--draft-mode", "greedy", "--controller", "fixed",
                                      "--q-mass", "0.9", "--q-max-entries", "64"], env={})
    check_config(cfg)
    assert (cfg.proposal.draft_mode, cfg.control.controller, cfg.sessions.max_sessions) == ("greedy", "fixed", 4)
    assert (cfg.proposal.q_mass, cfg.proposal.q_max_entries) == (0.9, 64)
    assert default_node_id().startswith("drafter-")


def test_config_defaults_draft_sampled_with_a_099_nucleus() -> None:
    cfg = load_config(DrafterConfig, ["--model", "/m"], env={})
    check_config(cfg)
    assert (cfg.proposal.draft_mode, cfg.proposal.q_mass, cfg.proposal.q_max_entries) == ("sampled", 0.98, 4096)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": ""}, "--model is required"),
    ({"verifier_url": "http://x"}, "--verifier-url must be a ws:// or wss:// URL"),
    ({"max_sessions": 0}, "--max-sessions must be in [1, 100000]"),
    ({"draft_mode": "beam"}, "--draft-mode must be one of sampled, greedy"),
    ({"q_mass": 0.0}, "--q-mass must be in (0, 1], got 0.0"),
    ({"q_mass": 1.5}, "--q-mass must be in (0, 1], got 1.5"),
    ({"q_max_entries": 0}, "--q-max-entries must be in [1, 4096], got 0"),
    ({"q_max_entries": 4097}, "--q-max-entries must be in [1, 4096], got 4097"),
    ({"controller": "psychic"}, "--controller must be one of adaspec, fixed, threshold"),
    ({"reconnect_s": 0.0}, "--reconnect-s must be > 0"),
    ({"log_level": "loud"}, "--log-level must be one of"),
])
def test_bad_config_names_the_flag(overrides: dict[str, object], message: str) -> None:
    cfg = from_flags(DrafterConfig, **{"model": "/m", **overrides})  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    assert message in str(info.value)


def _verdict(round_: int, finished: bool = False) -> Verdict:
    return Verdict(request_id="r", round=round_, accepted=0, token_ids=[1], finished=finished,
                   finish_reason="stop" if finished else None, draft_budget=0 if finished else 4)


@pytest.mark.asyncio
async def test_frames_that_arrive_while_drafting_wait_for_the_round_unless_one_is_final() -> None:
    """vLLM may end a round before its draft left; that Verdict must still reach the round."""
    import asyncio

    from services.drafter.rounds import _drain_final

    inbox: asyncio.Queue[object] = asyncio.Queue()
    inbox.put_nowait(_verdict(3))
    assert _drain_final(inbox) is None  # type: ignore[arg-type]
    assert inbox.qsize() == 1 and inbox.get_nowait() == _verdict(3)
    for v in (_verdict(3), _verdict(4, finished=True)):
        inbox.put_nowait(v)
    assert _drain_final(inbox) == _verdict(4, finished=True)  # type: ignore[arg-type]
    assert inbox.get_nowait() == _verdict(3)
