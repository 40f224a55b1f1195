"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3), on the KV arena.

It runs the loaded transformers model's own weights with a short, fixed sequence of kernels per
layer: one fused QKV matmul, rotary embedding on queries and keys together, one arena write,
per-session attention, one fused gate/up matmul. Compared with the generic transformers forward
it skips mask construction, cache objects and most small ops, which on a CPU are most of the
cost of a small model. Where :func:`fused_reason` allows (float32 on specfleet's row-wise kernel,
a SiLU MLP), each block is one C++ call instead (``rowwise.cpp``'s ``Layer``), which removes the
per-op dispatch that was half of a 1-row step. :func:`supports` says which configurations it implements exactly;
anything else runs through :mod:`shared.runner.hf`. The runner checks both against transformers
at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from shared.runner import rowwise
from shared.runner.invariant import GroupedPlan, group_rows, grouped_attention, row_attention
from shared.runner.matmul import Q4, Matmul, matmul, resolve_kernel
from shared.runner.step import StepPlan, paged_attention, write_kv
from shared.runner.topk import topk

#: logits per row the head recomputes in float32 after its half-precision matmul (LeanDecoder._refine_top)
REFINED = 16
#: rotary rows made at once at first (:meth:`LeanDecoder._rope`; the table doubles as positions grow)
ROPE_ROWS = 1024
SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "specfleet_llama"})
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def supports(model: Any) -> str:
    """Empty when this module implements ``model`` exactly; else the reason it does not."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model type {cfg.model_type!r} is not one of {sorted(SUPPORTED_TYPES)}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "some layers use sliding-window attention"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < cfg.max_position_embeddings:
        return f"sliding_window={window} is shorter than the context"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r} is not one of {sorted(STATIC_ROPE)}"
    if cfg.hidden_act not in ACT2FN:
        return f"activation {cfg.hidden_act!r} is unknown"
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings are not implemented"
    return ""


def fused_reason(model: Any, kernel: str, activations: torch.dtype) -> str:
    """Empty when each block can run as one C++ call (:func:`shared.runner.rowwise.layer`): float32
    or bfloat16 weights on the row-wise kernel, float32 activations, and a SiLU MLP; else why not (the block then
    runs as torch ops, :meth:`LeanDecoder._block`)."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    if kernel not in ("rowwise", Q4):
        return f"the matmuls run on {kernel}, not the row-wise kernel"
    if dtype not in (torch.float32, torch.bfloat16) or activations != torch.float32:
        return f"the weights are {dtype} and the activations {activations}, not float32 or bfloat16 and float32"
    if cfg.hidden_act != "silu":
        return f"the activation is {cfg.hidden_act!r}, not silu"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return "" if head_dim % 2 == 0 else "the head size is odd"


def _fuse(modules: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linear layers' weights (and biases) and make the layers views of the result,
    so the fused matmul costs no extra memory and the transformers model stays usable. A second
    runner on the same model reuses the first one's fused tensors."""
    done = getattr(modules[0], "_specfleet_fused", None)
    if done is not None and len(done[0]) == len(modules) and all(a is b for a, b in zip(done[0], modules, strict=True)):
        return done[1], done[2]
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype,
                                                                         device=weight.device)
                          for m, b in zip(modules, biases, strict=True)])
    row = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[row : row + rows], requires_grad=False)
        if bias is not None and m.bias is not None:
            m.bias = torch.nn.Parameter(bias[row : row + rows], requires_grad=False)
        row += rows
    modules[0]._specfleet_fused = (tuple(modules), weight, bias)
    return weight, bias


@dataclass
class _Layer:
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: Matmul
    o: Matmul
    gate_up: Matmul
    down: Matmul
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    native: Any = None  # the whole block as one C++ call (rowwise.layer), where LeanDecoder.fused


class LeanDecoder:
    """Forward of a supported decoder over a :class:`StepPlan`, writing keys/values to the arena.

    ``row_multiples`` (``(in, out)`` shape -> rows) makes it batch-invariant
    (:mod:`shared.runner.invariant`): each matmul over a multiple of its shape's row count, and
    attention grouped by key block over a multiple of ``attention_multiple`` rows (row by row
    where that is 0).

    ``activations`` is the dtype of everything but the weights' matmuls (the arena's): float32 over
    half-precision weights keeps the residual stream, the norms, rotary and attention in float32,
    as reference implementations keep their sensitive sums, and rounds to the weights' dtype only
    what goes into a matmul (:func:`shared.runner.runner.activation_dtype`)."""

    def __init__(self, model: Any, row_multiples: dict[tuple[int, int], int] | None = None,
                 activations: torch.dtype | None = None, attention_multiple: int = 0, kernel: str = "auto",
                 fuse: bool = True) -> None:
        cfg = model.config
        self.kernel = kernel  # the matmuls' (shared.runner.matmul.KERNELS)
        self.invariant = row_multiples is not None
        self.row_multiples = row_multiples or {}
        self.attention_multiple = attention_multiple if self.invariant else 0
        self.adtype = activations or next(model.parameters()).dtype

        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.intermediate = cfg.intermediate_size
        self.act = ACT2FN[cfg.hidden_act]
        self.scale = self.head_dim**-0.5
        base = model.model
        self.embed = base.embed_tokens.weight
        #: a factorised embedding and head (shared.factorised): rank -> hidden after the table, and
        #: hidden -> rank before it; None for a plain one
        up, down = getattr(base.embed_tokens, "up", None), getattr(model.lm_head, "down", None)
        self.embed_up = self._matmul(up.weight) if up is not None else None
        self.head_down = self._matmul(down.weight) if down is not None else None
        self.final_norm = self._small(base.norm.weight)
        self.lm_head = self._matmul(model.lm_head.weight, getattr(model.lm_head, "bias", None))
        self.rotary = base.rotary_emb
        half = self.head_dim // 2
        self.rot_sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(self.embed.device,
                                                                                          self.adtype)
        #: the rotary rows of positions 0.. (cos and sin), made by the model's own rotary module for many
        #: positions at once and grown on demand (:meth:`_rope`)
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.adtype, device=self.embed.device)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)  # the table's size, at most
        #: each block one C++ call (``fused_reason``): every op row by row, so invariant as it stands
        self.fused = fuse and not fused_reason(model, resolve_kernel(kernel, self.embed.device, self.embed.dtype),
                                               self.adtype)
        self.layers = [self._layer(layer) for layer in base.layers]

    def _layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gu_w, gu_b = _fuse([mlp.gate_proj, mlp.up_proj])
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        w = _Layer(
            norm_in=self._small(layer.input_layernorm.weight),
            norm_post=self._small(layer.post_attention_layernorm.weight),
            qkv=self._matmul(qkv_w, qkv_b), o=self._matmul(attn.o_proj.weight, attn.o_proj.bias),
            gate_up=self._matmul(gu_w, gu_b), down=self._matmul(mlp.down_proj.weight, mlp.down_proj.bias),
            q_norm=self._small(q_norm.weight) if q_norm is not None else None,
            k_norm=self._small(k_norm.weight) if k_norm is not None else None,
        )
        if self.fused:
            w.native = rowwise.layer(w.norm_in, w.qkv.weight, w.qkv.bias, w.o.weight, w.o.bias, w.norm_post,
                                     w.gate_up.weight, w.gate_up.bias, w.down.weight, w.down.bias, w.q_norm, w.k_norm,
                                     heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                     intermediate=self.intermediate, eps=self.eps, scale=self.scale)
        return w

    def matmuls(self) -> list[Matmul]:
        """Every weight matrix's product, in the order a forward runs them (``bench.costs --floor``
        times them alone: the most a step can reach with these kernels and no other op)."""
        ends = [m for m in (self.head_down, self.lm_head) if m is not None]
        layers = [m for w in self.layers for m in (w.qkv, w.o, w.gate_up, w.down)]
        return [*([self.embed_up] if self.embed_up is not None else []), *layers, *ends]

    def _matmul(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Matmul:
        inp, out = weight.shape[1], weight.shape[0]
        multiple = self.row_multiples.get((inp, out), max(self.row_multiples.values(), default=0))
        return matmul(weight, bias, multiple, self.kernel)

    def _small(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's weight in the activations' dtype (a copy of a few KB where that differs)."""
        return weight.detach().to(self.adtype)

    def hidden(self, plan: StepPlan, arena: torch.Tensor) -> torch.Tensor:
        """Run every layer; returns the final hidden states ``[T, hidden]`` (before the last norm)."""
        x = F.embedding(plan.input_ids, self.embed)
        if self.embed_up is not None:
            x = self.embed_up(x)
        x = x.to(self.adtype)  # the residual stream
        cos, sin = self._rope(x, plan.positions)
        if self.fused:
            return self._hidden_fused(x.contiguous(), cos, sin, plan, arena)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
        grouped = (group_rows(plan.spans, self.attention_multiple, self.kv_heads, self.heads // self.kv_heads,
                              self.adtype, x.device) if self.attention_multiple else None)
        for index, layer in enumerate(self.layers):
            x = self._block(x, layer, cos, sin, plan, arena[index], grouped)
        return x

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary rows ``cos, sin`` ``[T, D]`` of ``positions`` (sin with rotate_half's sign): rows of
        a table the model's rotary module made. A static rope's row is elementwise in its position
        (one product of position and frequency, then cos or sin), so a row of the table is bitwise the
        row a step's own call makes, without the module's dozen torch ops every step."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            grown = max(2 * self._cos.shape[0], ROPE_ROWS)
            upto = max(need, min(grown, self.max_positions) if self.max_positions > 0 else grown)
            cos, sin = self.rotary(x, torch.arange(upto, device=x.device).unsqueeze(0))
            self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions) * self.rot_sign

    def _hidden_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: StepPlan,
                      arena: torch.Tensor) -> torch.Tensor:
        spans = torch.tensor([(s.q_start, s.n, s.kv_start, s.kv_len) for s in plan.spans], dtype=torch.long)
        for index, layer in enumerate(self.layers):
            x = layer.native.forward(x, cos, sin, arena[index], plan.write_rows, spans)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(hidden, (hidden.shape[-1],), self.final_norm, self.eps)
        if self.head_down is not None:
            h = self.head_down(h)
        logits = self.lm_head(h).float()
        if self.lm_head.rounds and (self.lm_head.dtype != self.adtype or self.lm_head.kind == Q4):
            self._refine_top(logits, h.to(self.adtype))
        return logits

    def _refine_top(self, logits: torch.Tensor, h: torch.Tensor) -> None:
        """Each row's :data:`REFINED` largest logits again, in the activations' dtype (over 4-bit blocks:
        from the weight they were made from, so the draft's choice among them is the full weight's). A bfloat16
        matmul rounds its output: a logit near 25 to a multiple of 0.125, coarser than the margin
        between the top two tokens of many real steps (SmolLM2's first token of "What is the
        capital of France?": 25.36 against 25.26). Each refined logit is one dot product over the
        hidden size, reduced in the same order however many rows the step holds, so a row's logits
        still depend on the row alone (the runner's start-up invariance check covers it)."""
        head, bias = self.lm_head.source, self.lm_head.bias
        top = topk(logits, REFINED).indices  # [rows, REFINED]
        exact = (head[top].to(self.adtype) * h.unsqueeze(1)).sum(-1)
        if bias is not None:
            exact += bias[top].to(self.adtype)
        logits.scatter_(1, top, exact.float())

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, plan: StepPlan, grouped: GroupedPlan | None) -> torch.Tensor:
        if grouped is not None:
            return grouped_attention(q, kv, grouped, self.scale)
        if self.invariant:
            return row_attention(q, kv, plan, self.scale)
        return paged_attention(q, kv, plan, self.kv_heads, self.scale)

    def _block(self, x: torch.Tensor, w: _Layer, cos: torch.Tensor, sin: torch.Tensor, plan: StepPlan,
               kv: torch.Tensor, grouped: GroupedPlan | None) -> torch.Tensor:
        tokens, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = w.qkv(F.rms_norm(x, (x.shape[-1],), w.norm_in, self.eps))
        qkv = qkv.to(self.adtype).view(tokens, heads + 2 * kv_heads, dim)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        if w.q_norm is not None and w.k_norm is not None:
            q = F.rms_norm(q, (dim,), w.q_norm, self.eps)
            k = F.rms_norm(k, (dim,), w.k_norm, self.eps)
            qk = torch.cat([q, k], 1)
        else:
            qk = qkv[:, : heads + kv_heads]
        qk = qk * cos + qk.roll(dim // 2, -1) * sin  # rotary on queries and keys at once
        write_kv(kv, plan, qk[:, heads:], v)
        attn = self._attend(qk[:, :heads], kv, plan, grouped)
        x = x + w.o(attn)
        gate_up = w.gate_up(F.rms_norm(x, (x.shape[-1],), w.norm_post, self.eps))
        return x + w.down(self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
