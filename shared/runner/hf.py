"""The generic path: the transformers model's own forward, with specfleet's arena attention.

transformers lets a model call a registered attention function by name. This one writes the
step's new keys/values into the arena and attends per session (:func:`paged_attention`), so
any decoder whose attention is plain scaled dot-product works unchanged, at the cost of the
transformers forward's own overhead. Attention variants it does not implement (sliding
windows, logit soft-capping, attention sinks) are refused, never silently approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from shared.models import ModelLoadError
from shared.runner.step import StepPlan, paged_attention, write_kv

ATTN_NAME = "specfleet_arena"
#: keyword arguments transformers may pass that change the attention maths
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks")


class UnsupportedAttention(ModelLoadError):
    """A load error: the self-check meets it first, and callers report ModelLoadError cleanly."""


@dataclass
class _StepContext:
    plan: StepPlan
    arena: torch.Tensor


def _arena_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, specfleet_step: _StepContext | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    if specfleet_step is None:  # called outside a runner step: behave as transformers' own sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    window = kwargs.get("sliding_window")
    if window is not None and max(span.kv_len for span in specfleet_step.plan.spans) <= window:
        kwargs.pop("sliding_window")  # a window no session reaches changes nothing
    bad = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
    if bad:
        raise UnsupportedAttention(f"this model's attention uses {', '.join(bad)}, which the torch backend does not "
                                   "implement; serve it with the vLLM backend")
    kv = specfleet_step.arena[module.layer_idx]
    # in the arena's dtype (float32 over half-precision weights on a CPU: runner.activation_dtype)
    write_kv(kv, specfleet_step.plan, key[0].transpose(0, 1).to(kv.dtype), value[0].transpose(0, 1).to(kv.dtype))
    heads, dim = query.shape[1], query.shape[3]
    scale = scaling if scaling is not None else dim**-0.5
    out = paged_attention(query[0].transpose(0, 1).to(kv.dtype), kv, specfleet_step.plan, key.shape[1], scale)
    return out.to(query.dtype).view(1, -1, heads, dim), None


AttentionInterface.register(ATTN_NAME, _arena_attention)
# Outside a step the model must build the masks sdpa gets (padding!); transformers builds none for
# an attention name without a mask function. Inside a step HFDecoder passes an empty 4D mask
# (``no_mask``), so transformers builds none and _arena_attention ignores it.
AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


class HFDecoder:
    """Forward through transformers' own modules with the arena attention switched in."""

    def __init__(self, model: Any) -> None:
        model.set_attn_implementation(ATTN_NAME)
        self.model = model
        self.base = model.base_model  # .model for Llama-likes, .transformer for GPT-2, ...
        self.head = model.get_output_embeddings()
        device = next(model.parameters()).device
        self.no_mask = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)  # ignored by _arena_attention

    def hidden(self, plan: StepPlan, arena: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids=plan.input_ids.unsqueeze(0), position_ids=plan.positions.unsqueeze(0),
                        attention_mask=self.no_mask, use_cache=False, specfleet_step=_StepContext(plan, arena))
        return out.last_hidden_state[0]  # already through the final norm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
