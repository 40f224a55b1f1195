"""Pipeline settings: the drafts' shapes, the teacher's data plan, step budgets and paths.

Budgets are counted in optimiser steps (not wall time) so a re-run is reproducible; a per-stage
``max_minutes`` guard still stops a stage early on a slow machine, and the model card then says
how many steps it actually got.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from training.teacher import TeacherPlan


@dataclass(frozen=True)
class Shape:
    """A factorised Llama (shared.factorised): head_dim = hidden / heads (>= 32 so vLLM-CPU can load it)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    embed_rank: int
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Stage:
    """One training run: how many steps of how many tokens, at what peak learning rate."""

    steps: int
    batch_tokens: int
    lr: float
    warmup: int = 30
    max_minutes: float = 0.0  # 0: no wall-clock guard


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    #: the target, fetched and converted by shared.model_import (or a local directory)
    target: str = "smollm2-135m-instruct"
    heldout_percent: int = 8
    heldout_prompts: int = 120  # held-out prompts answered greedily for the evaluation
    teacher: TeacherPlan = field(default_factory=TeacherPlan)
    topk: int = 32  # teacher log-probabilities kept per position
    drafts: dict[str, Shape] = field(
        default_factory=lambda: {
            "draft-large": Shape(hidden=320, layers=4, heads=5, kv_heads=1, intermediate=896, embed_rank=96),
            "draft-small": Shape(hidden=256, layers=2, heads=4, kv_heads=1, intermediate=704, embed_rank=64),
        }
    )
    distill: dict[str, Stage] = field(
        default_factory=lambda: {
            "draft-large": Stage(steps=250, batch_tokens=4096, lr=2e-3, warmup=20, max_minutes=75),
            "draft-small": Stage(steps=250, batch_tokens=4096, lr=3e-3, warmup=20, max_minutes=45),
        }
    )
    #: committed teacher answers (token ids): costly to remake, small to store
    data_dir: Path = Path("training/data")
    state_dir: Path = Path(".specfleet/training")
    fetch_dir: Path = Path(".specfleet")  # where a known target is fetched to (its models/ folder)
    out_dir: Path = Path("models")
    checkpoint_every: int = 25


def toy_settings(target: str, state_dir: Path, out_dir: Path, data_dir: Path) -> Settings:
    """Minutes-not-hours shapes and budgets for the tests, on a tiny teacher."""
    tiny = Shape(hidden=64, layers=1, heads=1, kv_heads=1, intermediate=128, embed_rank=16, max_positions=512)
    return Settings(
        target=target,
        heldout_prompts=4,
        teacher=TeacherPlan(max_new_tokens=12, batch=8, token_budget=400),
        topk=8,
        drafts={"draft-large": replace(tiny, layers=2), "draft-small": tiny},
        distill={"draft-large": Stage(steps=12, batch_tokens=256, lr=3e-3, warmup=3),
                 "draft-small": Stage(steps=12, batch_tokens=256, lr=3e-3, warmup=3)},
        data_dir=data_dir,
        state_dir=state_dir,
        out_dir=out_dir,
        checkpoint_every=5,
    )
