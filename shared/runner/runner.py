"""ModelRunner: a loaded model, its KV arena, and one packed forward over many sessions.

    runner = ModelRunner(loaded, kv_budget_bytes=2 << 30)
    slot = runner.kv.allocate(prompt_len + max_new)          # None: no room now
    runner.forward([Segment(slot, prompt_ids, len(prompt_ids))])   # prefill, no logits
    logits = runner.forward([Segment(slot, [last, *drafts], 0)])   # [1 + k, V]
    slot.truncate(slot.length - rejected)                      # roll back: moves a length

The verifier and the drafter both run their models through this. Two implementations share
the arena and the step layout: ``lean`` (Llama-family decoders, see :mod:`shared.runner.lean`)
and ``hf`` (any decoder through transformers' own forward). ``auto`` picks lean where it
applies. Every runner checks itself against a plain transformers forward when it is built and
refuses to serve if they disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from shared.log import get_logger
from shared.models import LoadedModel, ModelLoadError
from shared.runner import lean
from shared.runner.hf import HFDecoder
from shared.runner.kv import KVArena, KVShape
from shared.runner.step import Segment, StepPlan, commit_step, plan_step

log = get_logger("runner")
RUNNER_KINDS = ("auto", "lean", "hf")
#: the self-check's tolerance on |logits - reference|, relative to the reference's largest |logit|
SELF_CHECK_RTOL = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}


class Decoder(Protocol):
    def hidden(self, plan: StepPlan, arena: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def kv_shape(model: object) -> KVShape:
    cfg = model.config  # type: ignore[attr-defined]
    heads = cfg.num_attention_heads
    return KVShape(layers=cfg.num_hidden_layers, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   dtype=next(model.parameters()).dtype)  # type: ignore[attr-defined]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv_budget_bytes: int, kind: str = "auto", self_check: bool = True) -> None:
        if kind not in RUNNER_KINDS:
            raise ModelLoadError(f"runner must be one of {', '.join(RUNNER_KINDS)}, got {kind!r}")
        model = loaded.model
        self.device = next(model.parameters()).device
        self.shape = kv_shape(model)
        self.groups = model.config.num_attention_heads // self.shape.kv_heads
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        why_not = lean.supports(model)
        if kind == "lean" and why_not:
            raise ModelLoadError(f"--runner lean cannot run {loaded.name}: {why_not}; use --runner hf")
        self.kind = "lean" if kind == "lean" or (kind == "auto" and not why_not) else "hf"
        self.decoder: Decoder = lean.LeanDecoder(model) if self.kind == "lean" else HFDecoder(model)
        self.kv = KVArena(self.shape, kv_budget_bytes, self.device)
        self._reference = model
        log.info("model runner ready", model=loaded.name, runner=self.kind, lean_unavailable=why_not or None,
                 kv_tokens=self.kv.tokens, kv_gib=round(self.kv.budget_bytes / 2**30, 3),
                 kv_bytes_per_token=self.shape.bytes_per_token)
        if self_check:
            self.check_against_reference()

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment]) -> torch.Tensor | None:
        """One forward over every segment; logits ``[rows, V]`` (float32) for the rows asked for,
        in segment order, or None when no segment wants any. Every fed token is then cached."""
        plan = plan_step(segments, self.groups, self.shape.dtype, self.device)
        hidden = self.decoder.hidden(plan, self.kv.data)
        commit_step(segments)
        if plan.rows_wanted == 0:
            return None
        if plan.logit_rows is not None:
            hidden = hidden.index_select(0, plan.logit_rows)
        return self.decoder.logits(hidden)

    @torch.inference_mode()
    def check_against_reference(self, tokens: int = 12) -> float:
        """Score a short sequence as two sessions in one packed step (one partly cached) and compare
        with transformers' plain forward. Raises ModelLoadError on disagreement; returns the error."""
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (tokens,), generator=gen).tolist()
        ref = self._reference(input_ids=torch.tensor([ids], device=self.device), use_cache=False).logits[0].float()
        a, b = self.kv.allocate(tokens), self.kv.allocate(tokens)
        if a is None or b is None:
            for slot in (a, b):
                if slot is not None:
                    self.kv.free(slot)
            raise ModelLoadError(f"the KV cache ({self.kv.tokens} tokens) is too small even for the {tokens}-token "
                                 "self-check; raise --kv-cache-gb")
        try:
            split = tokens // 2
            self.forward([Segment(a, ids[:split], split)])
            got = self.forward([Segment(a, ids[split:], 0), Segment(b, ids[:split], 0)])
        finally:
            self.kv.free(a)
            self.kv.free(b)
        assert got is not None
        want = torch.cat([ref[split:], ref[:split]])
        err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        if err > SELF_CHECK_RTOL.get(self.shape.dtype, 6e-2):
            raise ModelLoadError(f"the {self.kind} runner disagrees with transformers on this model (relative error "
                                 f"{err:.2e}); try --runner hf, or serve it with the vLLM backend")
        return err
