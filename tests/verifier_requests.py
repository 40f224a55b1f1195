"""Build an engine-core ``Request`` the way the core does (``RequestTable.add``), for tests that
judge or step requests by hand."""

from __future__ import annotations

from services.verifier.requests import Request, Sampler
from services.verifier.round import Stops
from shared.protocol import SamplingParams


def make_request(request_id: str, prompt_ids: list[int], params: SamplingParams, speculative: bool = True,
                 max_model_len: int = 512, eos_ids: frozenset[int] = frozenset(), drafter: str = "", *,
                 generated: list[int] | None = None, race: bool = False) -> Request:
    return Request(request_id, [*prompt_ids, *(generated or [])], Sampler.of(params, race),
                   Stops.of(params, len(prompt_ids), eos_ids, max_model_len), drafter=drafter, speculative=speculative)
