"""Measure the target's GGUF copies as drafts; write ``models/gguf/MEASUREMENTS.json`` and its page.

The same measurements as the distilled drafts' (``training/evaluate.py``), on the same held-out
answers, with each copy run the way a drafter runs it (its default ``--gguf-backend``: specfleet's
4-bit kernel for the Q4_1 copy, llama.cpp for the others, ``shared.runner.gguf_backend``):

- greedy agreement and Σ min(p, q) at T = 1, teacher-forced on the target's greedy answers, with
  p from the target as the services load it (dtype ``auto``);
- mean accepted per greedy round at k = 4, an exact replay of speculative rounds;
- one decode step at batch 1 on one thread (llama.cpp for the copy, specfleet's runner for the
  target), median of interleaved runs, as a fraction of the target's;
- the file's size and sha256, so a card can say whether the measured file is the one beside it.

``make demo-models-eval`` runs it after the distilled drafts; the cards beside each copy
(``shared.gguf_copies``) are rendered from what it writes.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shared.gguf_copies import MEASURED, copy_path
from shared.gguf_files import read_gguf, sha256_of
from shared.models import LoadedModel, cpu_flags, load_model
from shared.runner import ModelRunner, Segment
from shared.runner.gguf_backend import gguf_runner, resolve_backend
from shared.runner.llama import LlamaRunner
from shared.runner.runner import kv_shape
from shared.runner.step import SegmentRunner
from training.evaluate import COST_RUNS, COST_STEPS, ROUND_K, answer_logits, decode_ms, greedy_round_lengths
from training.teacher_logits import Sequence

THREADS = 2  # teacher forcing; the step is timed on one


def _copy_logits(runner: SegmentRunner, seq: Sequence) -> torch.Tensor:
    """The copy's logits ``[len(answer), V]`` at the positions predicting each answer token."""
    ids = seq.ids[:-1]
    slot = runner.kv.allocate(len(ids) + 1)
    assert slot is not None
    try:
        out = runner.forward([Segment(slot, ids, len(seq.prompt) - 1)])
        assert out is not None
        return out
    finally:
        runner.kv.free(slot)


@torch.inference_mode()
def copy_stats(target: Any, path: Path, held: list[Sequence]) -> dict[str, float]:
    info = read_gguf(path)
    longest = max(len(s.ids) for s in held)
    runner = gguf_runner(info, 4 * longest * info.kv_bytes_per_token, "auto", threads=THREADS, sequences=1)
    agree = accept = 0.0
    count, lengths = 0, []
    try:
        for seq in tqdm(held, desc=f"agreement {path.name}", leave=False):
            p = torch.softmax(answer_logits(target, seq), -1)
            q = torch.softmax(_copy_logits(runner, seq), -1)
            matches = q.argmax(-1) == torch.tensor(seq.answer)
            agree += float(matches.sum())
            accept += float(torch.minimum(p, q).sum())
            count += len(seq.answer)
            lengths += greedy_round_lengths(matches.tolist(), ROUND_K)
    finally:
        if isinstance(runner, LlamaRunner):
            runner.close()
    return {"greedy_agreement": round(agree / count, 4), "accept_t1": round(accept / count, 4),
            "mean_accepted_k4": round(sum(lengths) / len(lengths), 3), "positions": count}


@torch.inference_mode()
def step_costs(target: LoadedModel, copies: dict[str, Path], prompt: list[int]) -> dict[str, float]:
    """Median ms of one batch-1 decode step of the target and each copy (on its default backend, and a
    copy the specfleet backend runs also on llama.cpp, as "<width> llama.cpp"), one thread, interleaved."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens = len(prompt) + COST_STEPS + 8
    runners: dict[str, SegmentRunner] = {}
    try:
        runners["target"] = ModelRunner(target, tokens * 2 * kv_shape(target.model).bytes_per_token, "auto",
                                        self_check=False)
        for width, path in copies.items():
            info = read_gguf(path)
            runners[width] = gguf_runner(info, 4 * tokens * info.kv_bytes_per_token, "auto", threads=1, sequences=1)
            if not isinstance(runners[width], LlamaRunner):
                runners[f"{width} llama.cpp"] = LlamaRunner(info, 2 * tokens * info.kv_bytes_per_token, 1, 1)
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(COST_RUNS):
            for name, runner in runners.items():
                samples[name].append(decode_ms(runner, prompt))
        return {name: round(statistics.median(v), 3) for name, v in samples.items()}
    finally:
        torch.set_num_threads(before)
        for runner in runners.values():
            if isinstance(runner, LlamaRunner):
                runner.close()


def evaluate_copies(target_dir: Path, widths: tuple[str, ...], held: list[Sequence]) -> dict[str, Any]:
    """Every measurement of every copy beside ``target_dir`` (``specfleet fetch-model`` makes them)."""
    started = time.monotonic()
    copies = {w: copy_path(target_dir, w) for w in widths if copy_path(target_dir, w).is_file()}
    if not copies:
        raise FileNotFoundError(f"no GGUF copies beside {target_dir}; run `specfleet fetch-model` (with llama.cpp "
                                "installed: `make install`) first")
    target = load_model(target_dir)
    costs = step_costs(target, copies, held[0].prompt)
    models: dict[str, Any] = {}
    for width, path in copies.items():
        info = read_gguf(path)
        llama = costs.get(f"{width} llama.cpp")
        models[width] = {**copy_stats(target.model, path, held), "step_ms": costs[width],
                         "step_ratio": round(costs[width] / costs["target"], 4),
                         "backend": resolve_backend(info, "auto"),
                         **({"llama_cpp_step_ms": llama} if llama is not None else {}), "file": path.name,
                         "bytes": path.stat().st_size, "sha256": sha256_of(path),
                         "file_type": info.file_type}
    return {
        "target": {"name": target.name, "dtype": str(next(target.model.parameters()).dtype).removeprefix("torch."),
                   "step_ms": costs["target"]},
        "heldout": {"prompts": len(held), "positions": sum(len(s.answer) for s in held)},
        "machine": f"{platform.machine()}, {cpu_flag_summary()}",
        "date": time.strftime("%Y-%m-%d"),
        "method": {"greedy_agreement": "teacher-forced on the target's greedy answers to held-out prompts",
                   "accept_t1": "mean over the same positions of sum_x min(p(x), q(x)) at temperature 1",
                   "mean_accepted_k4": f"exact greedy speculative rounds with k={ROUND_K} on those answers",
                   "step": f"one batch-1 decode step, 1 thread (a copy on its default backend, `backend`: specfleet's "
                           f"4-bit kernel or llama.cpp; specfleet's runner with dtype auto for the target), median of "
                           f"{COST_RUNS} interleaved runs of {COST_STEPS} steps"},
        "models": models,
        "eval_seconds": round(time.monotonic() - started, 1),
    }


def cpu_flag_summary() -> str:
    """The CPU features that decide these numbers (AVX2, AVX512-BF16, ...), for a report's header."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "asimddp", "sve")
    flags = cpu_flags()
    if not flags:
        return "CPU flags unknown"
    have = [f for f in wanted if f in flags]
    return "CPU flags " + (" ".join(have) or "none of " + " ".join(wanted))


def write_report(report: dict[str, Any], path: Path = MEASURED) -> None:
    """MEASUREMENTS.json and README.md (a table of every copy) in ``models/gguf``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    t = report["target"]
    lines = ["# The target's GGUF copies as drafts", "",
             f"Measured by `make demo-models-eval` on {report['date']} ({report['machine']}), on the target's greedy "
             f"answers to {report['heldout']['prompts']} held-out chat prompts ({report['heldout']['positions']} "
             f"positions); the target {t['name']} in {t['dtype']}, {t['step_ms']:.2f} ms a step on one thread. "
             "`specfleet fetch-model` makes the copies and writes each one's card beside it from "
             "`MEASUREMENTS.json`.", "",
             "| copy | made by | run by (the drafter's default) | greedy agreement | Σ min(p, q) at T = 1 | "
             "accepted per round (k = 4) | step | step / target's | step on llama.cpp | size |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for width, m in report["models"].items():
        made = "the PyPI package, as shipped" if width == "Q4_1" else "llama.cpp's quantizer, from the Q4_1"
        backend = "specfleet's 4-bit kernel" if m.get("backend") == "specfleet" else "llama.cpp"
        llama = f"{m['llama_cpp_step_ms']:.2f} ms" if "llama_cpp_step_ms" in m else "(the same)"
        lines.append(f"| {m['file']} | {made} | {backend} | {m['greedy_agreement']:.3f} | {m['accept_t1']:.3f} | "
                     f"{m['mean_accepted_k4']:.2f} | {m['step_ms']:.2f} ms | {m['step_ratio']:.3f}× | {llama} | "
                     f"{m['bytes'] / 1e6:.1f} MB |")
    lines += ["", "The default target is itself dequantized from the shipped Q4_1 file, so the Q4_1 copy carries the "
              "target's very weights, and the Q8_0 copy (requantized from it) nearly so: they agree more than a 4-bit "
              "copy of a target trained in bfloat16 would. The Q4_0 copy, requantized from the Q4_1, is the fairer "
              "picture of a real 4-bit copy.", "",
              "specfleet's 4-bit kernel (`shared/runner/quant4.cpp`, `shared.runner.gguf_backend`) multiplies by the "
              "Q4_1 file's own blocks (every layer's matrix; the Q8_0 embedding, which is also the head, requantized "
              "to Q4_1 with each row's 16 best logits recomputed from the file's weights), and a Q8_0 file's cut to "
              "Q4_1, over activations quantized to int8 per block of 32, as llama.cpp's Q8_1 does; its step includes "
              "the drafter's Python per step.",
              ""]
    (path.parent / "README.md").write_text("\n".join(lines))
