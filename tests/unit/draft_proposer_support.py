"""Helpers shared by the draft-model proposer's tests: the tiny draft model, a proposer on its
own KV arena, and plain-transformers references."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.drafter.control.base import DraftController, StepDecision, StepFeatures, keep_until_stop
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import DraftJob, JobSession, Proposal
from services.drafter.proposers.draft_model import DraftModelProposer
from shared.models import LoadedModel, load_model, make_tiny_family
from shared.protocol import SamplingParams, Verdict
from shared.runner import ModelRunner
from shared.sampling import make_generator

PROMPT = [12, 40, 77, 5, 130, 9, 64]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
WARM = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=64, seed=3)
FULL_GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # drafts always have k tokens
K = 4
#: sessions of different prompt lengths, drafted in one batch
BATCH_PROMPTS = {"a": PROMPT, "b": [9, 9, 130, 64, 3, 88, 21, 150, 7, 42, 11, 260, 33], "c": [200, 14]}
FP16_RTOL = 2e-3  # float16 keeps 11 significant bits; renormalising adds one more rounding


def make(draft: LoadedModel, **kwargs: Any) -> DraftModelProposer:
    """A proposer on its own runner and KV arena (room for a few full-context sessions)."""
    runner = ModelRunner(draft, 4 * draft.max_model_len * 1024, self_check=False)
    return DraftModelProposer(runner, draft.eos_ids, **kwargs)


def gen(seed: int) -> torch.Generator:
    return make_generator(seed, "draft")


def propose(proposer: DraftModelProposer, session_id: str, k: int, params: SamplingParams,
            rng: torch.Generator, controller: DraftController | None = None) -> Proposal:
    """One session alone: a batch of one job."""
    proposals = proposer.propose([DraftJob(JobSession(session_id, params, rng), k, controller=controller)])
    assert len(proposals) == 1
    return proposals[0]


def reference_greedy(model: LoadedModel, ids: list[int], k: int) -> list[int]:
    """Argmax decoding with plain transformers calls, no cache: the ground truth."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(k):
            logits = model.model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def reference_draft(model: LoadedModel, ids: list[int], k: int) -> list[int]:
    """What a greedy request drafts: argmax decoding that ends after an end token."""
    out = reference_greedy(model, ids, k)
    ends = [i for i, t in enumerate(out) if t in model.eos_ids]
    return out[: ends[0] + 1] if ends else out


def reference_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids])).logits[0, -1]



def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny family's one-layer draft model, made in this session's temporary folder."""
    paths = make_tiny_family(Path(tmp_path_factory.getbasetemp()) / "tiny-family")
    return load_model(paths["draft-L1"])


class StopAt:
    """A controller that stops (keeping or discarding the token) at a given position."""

    name = "stop-at"
    wants_features = True
    wants_spread = True

    def __init__(self, position: int, decision: StepDecision) -> None:
        self.position, self.decision = position, decision
        self.seen: list[StepFeatures] = []

    def begin_round(self, budget: int) -> int:
        return budget

    def on_step(self, step: StepFeatures) -> StepDecision:
        self.seen.append(step)
        return self._decide(step)

    def keeps(self, steps: Sequence[StepFeatures], budget: int) -> int:
        return keep_until_stop(self._decide, steps, budget)

    def _decide(self, step: StepFeatures) -> StepDecision:
        return self.decision if step.position == self.position else StepDecision.CONTINUE

    def end_round(self, drafted: int, accepted: int) -> None:
        pass


def verdict(token_ids: list[int], accepted: int, finished: bool = False) -> Verdict:
    """The verifier's answer to session "s"'s round 0."""
    return Verdict(request_id="s", round=0, accepted=accepted, token_ids=token_ids, finished=finished,
                   finish_reason="length" if finished else None, draft_budget=0 if finished else K)


def outcomes(metrics: DrafterMetrics) -> dict[str, float]:
    """The drafter's lookahead counters by outcome."""
    get = metrics.registry.get_sample_value
    return {o: get("specfleet_drafter_lookaheads_total", {"outcome": o}) or 0.0 for o in ("used", "missed", "dropped")}
