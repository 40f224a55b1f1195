"""Tiny random decoders for the shared.runner tests, and a plain transformers reference.

Every parameter is random (biases and norm weights too: transformers initialises those to 0
and 1, which would hide a bias or norm weight the runner forgets), seeded, float32, eval mode.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers as tf

from shared.models import LoadedModel
from shared.runner import ModelRunner

VOCAB = 300
MAX_POSITIONS = 128
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
#: name -> (config class, model class, config overrides)
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "llama-bias": (tf.LlamaConfig, tf.LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama-mha-hd32": (tf.LlamaConfig, tf.LlamaForCausalLM, {"num_key_value_heads": 4, "head_dim": 32,
                                                              "num_hidden_layers": 3}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),  # q/k/v biases, no o_proj bias
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}),  # q_norm / k_norm
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
}
KV_BUDGET = 1 << 20  # bytes: a few thousand tokens for these shapes
#: where make_runner builds (pytest --device, set by tests/conftest.py; the GPU check passes cuda)
DEVICE = "cpu"


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> LoadedModel:
    config_cls, model_cls, arch_overrides = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **arch_overrides, **overrides})
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return wrap(model, arch)


def wrap(model: Any, name: str = "tiny") -> LoadedModel:
    """A LoadedModel without a tokenizer: the runner never needs one."""
    return LoadedModel(model=model, tokenizer=None, name=name, path="", fingerprint="",
                       max_model_len=int(model.config.max_position_embeddings),
                       vocab_size=int(model.config.vocab_size))


def make_runner(arch: str, kind: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides: Any) -> tuple[ModelRunner, torch.nn.Module]:
    """A runner over a tiny model, and an untouched copy of that model to take references from."""
    loaded = tiny_model(arch, seed, **overrides)
    loaded.model.to(device=DEVICE, dtype=dtype)
    reference = copy.deepcopy(loaded.model)
    runner = ModelRunner(loaded, KV_BUDGET, kind=kind)
    assert runner.kind == kind
    return runner, reference


def token_ids(n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


@torch.inference_mode()
def full_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' plain forward over the whole sequence, no cache: ``[len(ids), V]`` float32."""
    device = next(model.parameters()).device
    return model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float().cpu()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return float((got - want).abs().max()) / float(want.abs().max())


def assert_close(got: torch.Tensor | None, want: torch.Tensor, rtol: float = 1e-4) -> None:
    """|got - want| at most rtol times the largest |want| (the runner's own self-check measure)."""
    assert got is not None, "expected logits, got None"
    assert got.dtype == torch.float32
    err = rel_err(got.cpu(), want.cpu())
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"
