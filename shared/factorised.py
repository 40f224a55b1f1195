"""A Llama whose token embedding and output head share one low-rank table: specfleet's draft models.

A draft must use its target's tokenizer, and SmolLM2's has 49,152 tokens: a plain embedding at a
draft's width (256-384) would hold most of the draft's parameters and its head most of its step
time. Here a token is a row of a ``vocab × rank`` table (rank 64-128) projected up to the hidden
width, and the head projects the last hidden state down to ``rank`` and scores it against the
same table. Everything between is an ordinary Llama decoder, so specfleet's lean runner serves it.

Importing this module registers the ``specfleet_llama`` model type with transformers'
Auto classes, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads a draft directory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "specfleet_llama"


class FactorisedLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE

    def __init__(self, embed_rank: int = 128, **kwargs: Any) -> None:
        self.embed_rank = embed_rank
        super().__init__(**kwargs)


class FactorisedEmbedding(nn.Module):
    """ids -> ``up(weight[ids])``: a ``vocab × rank`` table, then ``rank -> hidden``."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, rank))
        self.up = nn.Linear(rank, hidden, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.up(F.embedding(ids, self.weight))


class FactorisedHead(nn.Module):
    """hidden -> logits: ``down(h) @ weight.T``, ``weight`` being the embedding's table (tied)."""

    def __init__(self, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, rank))
        self.down = nn.Linear(hidden, rank, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.down(hidden), self.weight)


class FactorisedLlamaForCausalLM(LlamaForCausalLM):
    config_class = FactorisedLlamaConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012 (transformers' form)

    def __init__(self, config: FactorisedLlamaConfig) -> None:
        super().__init__(config)
        rank, hidden, vocab = config.embed_rank, config.hidden_size, config.vocab_size
        self.model.embed_tokens = FactorisedEmbedding(vocab, rank, hidden)
        self.lm_head = FactorisedHead(vocab, rank, hidden)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, FactorisedEmbedding | FactorisedHead):
            module.weight.data.normal_(0.0, self.config.initializer_range)
            return
        super()._init_weights(module)


AutoConfig.register(MODEL_TYPE, FactorisedLlamaConfig)
AutoModelForCausalLM.register(FactorisedLlamaConfig, FactorisedLlamaForCausalLM)
