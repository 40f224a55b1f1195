"""The shared optimisation loop: AdamW, warmup + cosine, checkpoints, resume, progress bar.

Pretraining and distillation differ only in their loss, so both call ``run_stage`` with a loss
function. State is saved every ``checkpoint_every`` steps (atomically) and a ``done.json`` marks
a finished stage, so re-running the pipeline skips or continues instead of starting over.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from training.config import Stage

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Batches(Protocol):
    tokens: int  # answer tokens in one pass over the data

    def batch(self, step: int, batch_tokens: int) -> Any: ...


@dataclass
class StageResult:
    name: str
    steps: int
    planned_steps: int
    seconds: float
    final_loss: float
    stopped_early: bool
    tokens: int


def lr_at(step: int, stage: Stage) -> float:
    """Linear warmup to stage.lr, then cosine decay to 10 % of it at stage.steps."""
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    progress = min(1.0, (step - stage.warmup) / max(1, stage.steps - stage.warmup))
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run_stage(
    name: str,
    model: torch.nn.Module,
    loss_fn: LossFn,
    sampler: Batches,
    stage: Stage,
    ckpt_dir: Path,
    checkpoint_every: int = 100,
) -> StageResult:
    """Train model in place (resuming from ckpt_dir) and return what was done."""
    done_path, state_path = ckpt_dir / "done.json", ckpt_dir / "state.pt"
    if done_path.exists():
        done = StageResult(**json.loads(done_path.read_text()))
        if done.steps >= stage.steps and not done.stopped_early:
            model.load_state_dict(torch.load(state_path, weights_only=True)["model"])
            return done
        done_path.unlink()  # a longer budget than last time: continue from the saved state
    opt = torch.optim.AdamW(model.parameters(), lr=stage.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, elapsed, ema = 0, 0.0, float("nan")
    if state_path.exists():
        state = torch.load(state_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed, ema = int(state["step"]), float(state["elapsed"]), float(state["ema"])
    model.train()
    started = time.monotonic() - elapsed
    bar = tqdm(total=stage.steps, initial=step, desc=name, unit="step", dynamic_ncols=True)
    stopped_early = False
    while step < stage.steps:
        if stage.max_minutes and time.monotonic() - started > stage.max_minutes * 60:
            stopped_early = True
            break
        loss = _one_step(model, opt, loss_fn, sampler.batch(step, stage.batch_tokens), lr_at(step, stage))
        ema = loss if math.isnan(ema) else 0.95 * ema + 0.05 * loss
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr_at(step - 1, stage):.1e}")
        if step % checkpoint_every == 0 or step == stage.steps:
            _save(state_path, model, opt, step, time.monotonic() - started, ema)
    bar.close()
    seconds = time.monotonic() - started
    _save(state_path, model, opt, step, seconds, ema)
    result = StageResult(name, step, stage.steps, round(seconds, 1), round(ema, 4), stopped_early,
                         step * stage.batch_tokens)
    done_path.write_text(json.dumps(asdict(result), indent=2))
    model.eval()
    return result


def _one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: LossFn, batch: Any, lr: float) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = loss_fn(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def _save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, elapsed: float,
          ema: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed, "ema": ema}
    torch.save(state, tmp)
    tmp.replace(path)
