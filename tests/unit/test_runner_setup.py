"""Building a ModelRunner: which models the lean path takes, the fallback to hf, the self-check,
and what each path does to the transformers model it runs (fused weights, attention switch)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from shared.models import LoadedModel, ModelLoadError, load_model
from shared.runner import ModelRunner, Segment, hf, lean, step
from shared.runner.matmul import matmul
from tests.unit.runner_models import (
    COMMON,
    KV_BUDGET,
    MAX_POSITIONS,
    VOCAB,
    assert_close,
    full_logits,
    make_runner,
    tiny_model,
    token_ids,
    wrap,
)

KINDS = ["lean", "hf"]


def _model(config_cls: Any, model_cls: Any, **overrides: Any) -> LoadedModel:
    torch.manual_seed(0)
    return wrap(model_cls(config_cls(**{**COMMON, **overrides})).eval())


def dynamic_rope() -> LoadedModel:
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return _model(tf.LlamaConfig, tf.LlamaForCausalLM, rope_parameters=rope)


def olmo() -> LoadedModel:  # Llama-like, but not a type the lean path knows
    return _model(tf.OlmoConfig, tf.OlmoForCausalLM)


def gpt2() -> LoadedModel:  # no .model / .lm_head: the hf path must find the decoder and head itself
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS,
                           bos_token_id=1, eos_token_id=2)
    return wrap(tf.GPT2LMHeadModel(config).eval())


def sliding_qwen2() -> LoadedModel:
    return _model(tf.Qwen2Config, tf.Qwen2ForCausalLM, use_sliding_window=True, sliding_window=8,
                  layer_types=["full_attention", "sliding_attention"])


def _rope(rope_type: str, **extra: Any) -> LoadedModel:
    return _model(tf.LlamaConfig, tf.LlamaForCausalLM, rope_parameters={"rope_type": rope_type, "rope_theta": 1e4,
                                                                          **extra})


# --- which path runs a model ---------------------------------------------------------------


@pytest.mark.parametrize(("build", "reason"), [
    (sliding_qwen2, "sliding-window"),
    (lambda: _model(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=16), "sliding_window=16"),
    (dynamic_rope, "rope type 'dynamic'"),
    (olmo, "model type 'olmo'"),
    (gpt2, "model type 'gpt2'"),
])
def test_lean_refuses_what_it_does_not_implement(build: Any, reason: str) -> None:
    loaded = build()
    assert reason in lean.supports(loaded.model)
    with pytest.raises(ModelLoadError, match="--runner lean cannot run") as info:
        ModelRunner(loaded, KV_BUDGET, kind="lean")
    assert reason in str(info.value) and "--runner hf" in str(info.value)


@pytest.mark.parametrize("build", [
    lambda: tiny_model("mistral", sliding_window=MAX_POSITIONS),  # a window as long as the context is no window
    lambda: _rope("linear", factor=2.0),
    lambda: _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),
    lambda: _rope("yarn", factor=4.0, original_max_position_embeddings=32),
])
def test_lean_takes_static_rope_variants(build: Any) -> None:
    loaded = build()
    assert lean.supports(loaded.model) == ""
    reference = copy.deepcopy(loaded.model)
    runner = ModelRunner(loaded, KV_BUDGET)
    assert runner.kind == "lean"
    ids = token_ids(100, seed=5)  # past original_max_position_embeddings
    slot = runner.kv.allocate(100)
    assert slot is not None
    assert_close(runner.forward([Segment(slot, ids, 90)]), full_logits(reference, ids)[90:])


@pytest.mark.parametrize("build", [dynamic_rope, olmo, gpt2])
def test_auto_falls_back_to_hf(build: Any) -> None:
    loaded = build()
    reference = copy.deepcopy(loaded.model)
    runner = ModelRunner(loaded, KV_BUDGET, kind="auto")  # and passes its self-check
    assert runner.kind == "hf"
    ids = token_ids(20, seed=6)
    slots = [runner.kv.allocate(20), runner.kv.allocate(20)]
    runner.forward([Segment(slots[0], ids[:8], 8)])
    got = runner.forward([Segment(slots[0], ids[8:], 0), Segment(slots[1], ids[:5], 2)])
    want = full_logits(reference, ids)
    assert_close(got, torch.cat([want[8:], want[2:5]]))


def test_auto_picks_lean_where_it_applies() -> None:
    assert ModelRunner(tiny_model("qwen3"), KV_BUDGET).kind == "lean"


def test_attention_hf_does_not_implement_is_a_load_error() -> None:
    """Sliding windows: lean says no, hf refuses the window rather than ignoring it."""
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelRunner(sliding_qwen2(), KV_BUDGET, kind="auto")
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelRunner(sliding_qwen2(), KV_BUDGET, kind="hf")


def test_unknown_runner_kind() -> None:
    with pytest.raises(ModelLoadError, match="runner must be one of auto, lean, hf"):
        ModelRunner(tiny_model("llama"), KV_BUDGET, kind="fast")


# --- the self-check ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_self_check_passes_and_cleans_up(kind: str) -> None:
    runner, _ = make_runner("llama-bias", kind)
    assert runner.check_against_reference() < 1e-5
    assert runner.kv.sessions == 0 and runner.kv.largest_free == runner.kv.tokens


def test_self_check_catches_a_wrong_fused_weight() -> None:
    runner, _ = make_runner("qwen2", "lean")
    layer = runner.decoder.layers[1]
    wrong = matmul(layer.qkv.source * 1.05, layer.qkv.bias)  # a copy: the model keeps the right weights
    if layer.native is not None:  # a fused block reads the packed weight itself
        layer.qkv.weight.copy_(wrong.weight)
    else:
        layer.qkv = wrong
    with pytest.raises(ModelLoadError, match="the lean runner disagrees with transformers"):
        runner.check_against_reference()
    assert runner.kv.sessions == 0  # its slots are freed even so


def test_self_check_catches_a_wrong_rotary() -> None:
    runner, _ = make_runner("llama", "lean")
    runner.decoder.rot_sign = -runner.decoder.rot_sign
    with pytest.raises(ModelLoadError, match="disagrees"):
        runner.check_against_reference()


@pytest.mark.parametrize("kind", KINDS)
def test_self_check_at_construction_catches_a_wrong_mask(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    no_mask = lambda n, past, groups, dtype, device: torch.zeros(groups * n, past + n, dtype=dtype)  # noqa: E731
    monkeypatch.setattr(step, "_causal_tail_mask", no_mask)  # new tokens would see later new tokens
    with pytest.raises(ModelLoadError, match=f"the {kind} runner disagrees"):  # torch ops: fused blocks mask in C++
        ModelRunner(tiny_model("llama"), KV_BUDGET, kind=kind, fuse=False)
    ModelRunner(tiny_model("llama"), KV_BUDGET, kind=kind, self_check=False)  # built, unchecked, when asked


@pytest.mark.parametrize("kind", KINDS)
def test_self_check_catches_wrong_attention(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = lean if kind == "lean" else hf
    real = step.paged_attention
    monkeypatch.setattr(module, "paged_attention", lambda q, kv, plan, kv_heads, scale: real(q, kv, plan, kv_heads,
                                                                                            scale * 0.5))
    with pytest.raises(ModelLoadError, match="disagrees"):
        ModelRunner(tiny_model("mistral"), KV_BUDGET, kind=kind, fuse=False)


# --- what the runner does to the transformers model -----------------------------------------


def _storages(model: torch.nn.Module) -> dict[int, int]:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


@pytest.mark.parametrize("arch", ["llama-bias", "qwen2", "qwen3", "llama-tied"])
def test_lean_fusion_keeps_the_model_unchanged_without_copies(arch: str) -> None:
    loaded = tiny_model(arch)
    model = loaded.model
    ids = token_ids(16, seed=7)
    before = full_logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = ModelRunner(loaded, KV_BUDGET, kind="lean")

    assert_close(full_logits(model, ids), before, rtol=1e-6)  # still a working transformers model
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert sum(_storages(model).values()) == param_bytes  # fused, not duplicated
    for layer, fused in zip(model.model.layers, runner.decoder.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        assert attn.q_proj.weight.data_ptr() == fused.qkv.source.data_ptr()
        assert attn.k_proj.weight.data_ptr() == fused.qkv.source[q_rows].data_ptr()
        assert attn.v_proj.weight.data_ptr() == fused.qkv.source[q_rows + k_rows].data_ptr()
        assert mlp.gate_proj.weight.data_ptr() == fused.gate_up.source.data_ptr()
        assert mlp.up_proj.weight.data_ptr() == fused.gate_up.source[mlp.gate_proj.weight.shape[0]].data_ptr()
        if attn.q_proj.bias is not None:
            assert fused.qkv.bias is not None
            assert attn.v_proj.bias.data_ptr() == fused.qkv.bias[q_rows + k_rows].data_ptr()
        else:
            assert fused.qkv.bias is None
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_still_works_outside_runner_steps(kind: str) -> None:
    """Padded batches and cached generation, called directly, give what they gave before."""
    loaded = tiny_model("qwen2")
    model = loaded.model
    ids = torch.tensor([token_ids(10, seed=8), token_ids(10, seed=9)])
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.inference_mode():
        padded = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    runner = ModelRunner(loaded, KV_BUDGET, kind=kind)
    slot = runner.kv.allocate(10)
    assert slot is not None
    runner.forward([Segment(slot, ids[0].tolist(), 0)])  # a step between the direct calls
    if kind == "hf":
        assert model.config._attn_implementation == hf.ATTN_NAME
    with torch.inference_mode():
        assert_close(model(input_ids=ids, attention_mask=mask).logits[mask.bool()], padded[mask.bool()], rtol=1e-6)
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), generated)


# --- a model loaded from disk ----------------------------------------------------------------


def test_tiny_family_from_disk(tiny_models: dict[str, Path]) -> None:
    target, draft = load_model(tiny_models["target"]), load_model(tiny_models["draft-L1"])
    for loaded in (target, draft):
        reference = copy.deepcopy(loaded.model)
        runner = ModelRunner(loaded, 4 * loaded.max_model_len * 1024)
        assert runner.kind == "lean" and runner.vocab_size == loaded.vocab_size
        assert runner.groups == 2  # 2 heads over 1 kv head
        ids = token_ids(40, seed=11, vocab=loaded.vocab_size)
        slot = runner.kv.allocate(48)
        assert slot is not None
        runner.forward([Segment(slot, ids[:30], 30)])
        got = runner.forward([Segment(slot, ids[30:], 0)])
        assert_close(got, full_logits(reference, ids)[30:])
