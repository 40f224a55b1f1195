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

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from shared.log import get_logger
from shared.models import LoadedModel, ModelLoadError
from shared.runner import lean, rowwise
from shared.runner.hf import HFDecoder
from shared.runner.invariant import KEY_BLOCK, clear_key_padding, probe_attention_multiple, probe_row_multiples
from shared.runner.kv import KVArena, KVError, KVShape
from shared.runner.matmul import Q4, resolve_kernel
from shared.runner.step import Segment, StepPlan, commit_step, plan_step

log = get_logger("runner")


class NotInvariantError(ModelLoadError):
    """This machine's matmuls in the model's dtype give a row different results at every row multiple probed."""


RUNNER_KINDS = ("auto", "lean", "hf")
#: the self-check's tolerance on |logits - reference|, relative to the reference's largest |logit|
SELF_CHECK_RTOL = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
#: the same over 4-bit weights (a draft's): they and the int8 activations approximate the model's own
Q4_SELF_CHECK_RTOL = 0.2


class Decoder(Protocol):
    def hidden(self, plan: StepPlan, arena: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def weight_dtype(model: object) -> torch.dtype:
    return next(model.parameters()).dtype  # type: ignore[attr-defined]


def activation_dtype(model: object) -> torch.dtype:
    """The dtype of a forward's activations and KV cache: float32 over half-precision weights on a
    CPU (only the matmuls read bfloat16 or float16 weights, which is where the bytes are), the
    weights' own dtype elsewhere. Rounding the residual stream and the attention scores to
    bfloat16 flips near-tied argmaxes that float32 keeps (docs/dtype.md has the measurements)."""
    param = next(model.parameters())  # type: ignore[attr-defined]
    half = param.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and param.device.type == "cpu" else param.dtype


def kv_shape(model: object) -> KVShape:
    cfg = model.config  # type: ignore[attr-defined]
    heads = cfg.num_attention_heads
    return KVShape(layers=cfg.num_hidden_layers, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   dtype=activation_dtype(model))


def linear_shapes(model: object) -> list[tuple[int, int]]:
    """(in, out) of every matmul a lean forward runs, the LM head last."""
    cfg = model.config  # type: ignore[attr-defined]
    shape = kv_shape(model)
    heads = cfg.num_attention_heads
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (heads + 2 * shape.kv_heads) * shape.head_dim
    body = [(hidden, qkv), (heads * shape.head_dim, hidden), (hidden, 2 * inter), (inter, hidden)]
    rank = getattr(cfg, "embed_rank", 0)  # a factorised embedding and head (shared.factorised)
    head = [(rank, hidden), (hidden, rank), (rank, cfg.vocab_size)] if rank else [(hidden, cfg.vocab_size)]
    return body + head


class ModelRunner:
    """``batch_invariant``: every position's logits are bitwise independent of the step's shape
    (:mod:`shared.runner.invariant`), proven on the model at start-up; the verifier's default.
    ``activations``: the activations' and KV cache's dtype, :func:`activation_dtype` when None (the
    fidelity benchmark also runs half-precision activations, to measure what float32 ones buy).
    ``matmul``: the lean forward's matmul kernel (:data:`shared.runner.matmul.KERNELS`).
    ``fuse``: run each block as one C++ call where :func:`shared.runner.lean.fused_reason` allows
    (False: as torch ops, which the benchmarks compare against).
    ``kv_dtype``: float16 keeps the KV cache in float16 under float32 activations, where the blocks are
    fused (``rowwise.Layer`` converts as it writes and reads); the 4-bit draft's (``gguf_backend.q4_runner``).
    None: the activations' dtype."""

    def __init__(self, loaded: LoadedModel, kv_budget_bytes: int, kind: str = "auto", self_check: bool = True,
                 batch_invariant: bool = False, activations: torch.dtype | None = None,
                 matmul: str = "auto", fuse: bool = True, kv_dtype: torch.dtype | None = None) -> None:
        if kind not in RUNNER_KINDS:
            raise ModelLoadError(f"runner must be one of {', '.join(RUNNER_KINDS)}, got {kind!r}")
        model = loaded.model
        self.device = next(model.parameters()).device
        self.shape = kv_shape(model)
        if activations is not None:
            self.shape = dataclasses.replace(self.shape, dtype=activations)
        self.activations = self.shape.dtype  # of a forward's rows; self.shape.dtype becomes the KV cache's below
        self.weight_dtype = weight_dtype(model)
        try:  # what the matmuls run on (a kernel named but unable to run here is refused now)
            self.matmul = resolve_kernel(matmul, self.device, self.weight_dtype)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        if self.matmul == Q4 and (odd := [i for i, _ in linear_shapes(model) if i % 32]):
            raise ModelLoadError(f"4-bit matmuls need widths that are multiples of 32; {loaded.name} has {odd[0]}")
        self.groups = model.config.num_attention_heads // self.shape.kv_heads
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        why_not = lean.supports(model)
        if kind == "lean" and why_not:
            raise ModelLoadError(f"--runner lean cannot run {loaded.name}: {why_not}; use --runner hf")
        self.kind = "lean" if kind == "lean" or (kind == "auto" and not why_not) else "hf"
        if self.matmul == Q4 and self.kind != "lean":
            raise ModelLoadError(f"4-bit matmuls run in the lean runner, which cannot run {loaded.name}: "
                                 f"{why_not or '--runner hf was asked for'}")
        multiples = self._invariant_rows(loaded, why_not) if batch_invariant else None
        #: the largest row multiple a matmul pads to (0: not invariant)
        self.row_multiple = max(multiples.values(), default=1) if multiples is not None else 0
        self.batch_invariant = batch_invariant
        #: each block one C++ call, every row alone (lean.fused_reason says why not, where not)
        self.fused = fuse and self.kind == "lean" and not lean.fused_reason(model, self.matmul, self.activations)
        #: the row multiple batch-invariant attention pads a key block's rows to (0: row by row, as
        #: the fused blocks always attend)
        self.attention_multiple = (probe_attention_multiple(self.shape.kv_heads, self.groups, self.shape.head_dim,
                                                            self.activations, self.device)
                                   if batch_invariant and not self.fused else 0)
        self.decoder: Decoder = (lean.LeanDecoder(model, multiples, self.activations, self.attention_multiple,
                                                  self.matmul, fuse=self.fused)
                                 if self.kind == "lean" else HFDecoder(model))
        if kv_dtype == torch.float16 and self.fused:  # only the fused blocks read a float16 cache
            self.shape = dataclasses.replace(self.shape, dtype=kv_dtype)
        self.kv = KVArena(self.shape, kv_budget_bytes, self.device, KEY_BLOCK if self.attention_multiple else 1)
        self._reference = model
        log.info("model runner ready", model=loaded.name, runner=self.kind, lean_unavailable=why_not or None,
                 matmul=self.matmul if self.kind == "lean" else None, fused_blocks=self.fused,
                 bfloat16_pairs_on=_pairs_on(self.matmul, self.weight_dtype) if self.kind == "lean" else None,
                 dtype=_name(self.weight_dtype), activations=_name(self.activations), kv_cache=_name(self.shape.dtype),
                 batch_invariant=batch_invariant,
                 row_multiple=self.row_multiple or None, attention_multiple=self.attention_multiple or None,
                 kv_tokens=self.kv.tokens,
                 kv_gib=round(self.kv.budget_bytes / 2**30, 3), kv_bytes_per_token=self.shape.bytes_per_token)
        if self_check:
            self.check_against_reference()
        if batch_invariant:
            self.check_invariance()

    def _invariant_rows(self, loaded: LoadedModel, why_not: str) -> dict[tuple[int, int], int]:
        if self.kind != "lean":
            raise ModelLoadError(f"batch invariance needs the lean runner, which cannot run {loaded.name}: "
                                 f"{why_not or '--runner hf was asked for'}; pass --batch-invariant false")
        rows = probe_row_multiples(linear_shapes(loaded.model), self.weight_dtype, self.device, self.matmul)
        if not all(rows.values()):
            raise NotInvariantError(f"this machine's {self.weight_dtype} matmuls give a row different results at every "
                                 "batch size probed, so speculation could change the text; try --dtype float32 "
                                 "or bfloat16, or pass --batch-invariant false")
        return rows

    def describe(self) -> dict[str, object]:
        """What ``/status`` shows of the model's numerics."""
        return {"dtype": _name(self.weight_dtype), "activations": _name(self.activations),
                "kv_cache": _name(self.shape.dtype), "runner": self.kind,
                "matmul": self.matmul if self.kind == "lean" else None, "fused_blocks": self.fused,
                "batch_invariant": self.batch_invariant,
                "invariant_row_multiple": self.row_multiple,
                "invariant_attention_multiple": self.attention_multiple}

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment]) -> torch.Tensor | None:
        """One forward over every segment; logits ``[rows, V]`` (float32) for the rows asked for,
        in segment order, or None when no segment wants any. Every fed token is then cached."""
        plan = plan_step(segments, self.groups, self.activations, self.device)
        if self.attention_multiple:
            clear_key_padding(segments, self.kv)
        hidden = self.decoder.hidden(plan, self.kv.data)
        commit_step(segments)
        if plan.rows_wanted == 0:
            return None
        if plan.logit_rows is not None:
            hidden = hidden.index_select(0, plan.logit_rows)
        return self.decoder.logits(hidden)

    @torch.inference_mode()
    def check_invariance(self, tokens: int = 40) -> None:
        """Score one sequence twice: one token per step alone, then in steps of 1-8 tokens beside
        another session's rows. Raises ModelLoadError unless every logit is bitwise the same."""
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.vocab_size, (tokens,), generator=gen).tolist()
        other = torch.randint(0, self.vocab_size, (tokens,), generator=gen).tolist()
        slots = [slot for slot in (self.kv.allocate(tokens) for _ in range(3)) if slot is not None]
        try:
            if len(slots) < 3:
                raise ModelLoadError(f"the KV cache ({self.kv.tokens} tokens) is too small for the {tokens}-token "
                                     "invariance check; raise --kv-cache-gb")
            a, b, c = slots
            one = [self.forward([Segment(a, [t], 0)]) for t in ids]
            wide: list[torch.Tensor] = []
            fed, widths = 0, (3, 1, 5, 8, 2, 6, 4, 7)
            while fed < tokens:
                n = min(widths[len(wide) % len(widths)], tokens - fed)
                rows = self.forward([Segment(c, other[fed : fed + n], 0), Segment(b, ids[fed : fed + n], 0)])
                assert rows is not None
                wide.append(rows[n:])
                fed += n
        finally:
            for slot in slots:
                self.kv.free(slot)
        if not torch.equal(torch.cat([r for r in one if r is not None]), torch.cat(wide)):
            raise ModelLoadError(f"the batch-invariance self-check failed for {self.weight_dtype} on this machine: a "
                                 "position's logits changed with the step's shape; pass --batch-invariant false "
                                 "(speculation may then change greedy text in rare near-ties)")

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
        if err > (Q4_SELF_CHECK_RTOL if self.matmul == Q4 else SELF_CHECK_RTOL.get(self.weight_dtype, 6e-2)):
            raise ModelLoadError(f"the {self.kind} runner disagrees with transformers on this model (relative error "
                                 f"{err:.2e}); try --runner hf, or serve it with the vLLM backend")
        return err


@torch.inference_mode()
def greedy_decode(runner: ModelRunner, prompt: Sequence[int], tokens: int, eos: set[int]) -> list[int]:
    """Greedy decoding through ``runner`` in a slot of its own, one token a step (as target-only
    serving decodes): up to ``tokens`` new tokens, the end-of-sequence token included if reached."""
    slot = runner.kv.allocate(len(prompt) + tokens)
    if slot is None:
        raise KVError(f"no room in the KV cache for {len(prompt) + tokens} tokens")
    try:
        out: list[int] = []
        feed = list(prompt)
        while len(out) < tokens and (not out or out[-1] not in eos):
            logits = runner.forward([Segment(slot, feed, len(feed) - 1)])
            assert logits is not None
            feed = [int(logits[-1].argmax())]
            out.append(feed[0])
        return out
    finally:
        runner.kv.free(slot)


def _pairs_on(kernel: str, dtype: torch.dtype) -> str | None:
    """What the row-wise kernel multiplies bfloat16 pairs on here (None: no pairs in this runner)."""
    if kernel != "rowwise" or dtype != torch.bfloat16 or not rowwise.pairs_available():
        return None
    return "amx" if rowwise.amx_available() else "avx512_bf16"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
