"""Offline profile of the verifier's step time (WISP's estimator, wisp.txt §4.4 eq. 19).

    python -m services.verifier.profile --model .specfleet/models/smollm2-135m-instruct \
        --out .specfleet/verifier-profile.json

Loads the target with specfleet's own model runner, times one ``ModelRunner.forward`` over
many batch shapes (the median of ``--repeats`` passes over all shapes, each forward after an
untimed one of the same shape, ``--threads`` torch threads), fits eq. 19
(:mod:`services.verifier.batching.estimator`) on a random 80 % of the batches, prints R² and
MAPE on the training batches and on the held-out 20 %, and writes the estimator JSON that the
verifier reads with ``--estimator-file``.

The batches: homogeneous ones (every session alike), mixed ones (each session its own context
and draft), and some with a prefill chunk beside the verification rounds, as the verifier's
scheduler builds them. Sessions feed 1 to 9 tokens after 32 to 1024 cached rows (at most the
model's context); a prefill chunk feeds 32 to 256 prompt tokens and asks for no logits, a
verification segment asks for logits on every row. Cached rows hold random keys and values:
a session's context is its slot's length, so no prefill is needed to set a shape up (the cost
of attention depends on how many rows it reads, not on their values).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from services.verifier.batching.estimator import FitReport, Sample, SegmentShape, StepTimeEstimator, evaluate, fit
from shared.models import LoadedModel, ModelLoadError, load_model
from shared.runner import ModelRunner, Segment
from shared.runner.invariant import KEY_BLOCK
from shared.runner.runner import kv_shape

BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (32, 64, 128, 256, 512, 768, 1024)
NEW_TOKENS = (1, 2, 3, 5, 7, 9)
#: segments feeding more tokens than this are prefill chunks (no logits)
MAX_VERIFY_NEW = 16
PREFILL_CHUNK = (32, 256)
WARMUP = 1
BATCHES, QUICK_BATCHES = 400, 120


def plan_batches(max_batch: int, count: int, max_len: int, seed: int = 0) -> list[list[SegmentShape]]:
    """``count`` batch shapes: a third homogeneous, the rest mixed, every fourth with a prefill chunk."""
    rng = random.Random(seed)
    sizes = sorted({b for b in BATCH_SIZES if b < max_batch} | {max_batch})
    batches = []
    for i in range(count):
        size = rng.choice(sizes)
        if i % 3 == 0:
            new, ctx = rng.choice(NEW_TOKENS), rng.choice(CONTEXTS)
            batch = [_shape(ctx, new, max_len)] * size
        else:
            batch = [
                _shape(_log_uniform(rng, CONTEXTS[0], CONTEXTS[-1]), rng.choice(NEW_TOKENS), max_len)
                for _ in range(size)
            ]
        if i % 4 == 1:
            chunk = _log_uniform(rng, *PREFILL_CHUNK)
            cached = rng.choice((0, 0, _log_uniform(rng, CONTEXTS[0], CONTEXTS[-1])))
            batch.append(_shape(cached, chunk, max_len))
        batches.append(batch)
    return batches


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(lo * (hi / lo) ** rng.random())


def _shape(cached: int, new: int, max_len: int) -> SegmentShape:
    new = min(new, max_len)
    return SegmentShape(new=new, cached=max(0, min(cached, max_len - new)))


def make_runner(loaded: LoadedModel, batches: Sequence[Sequence[SegmentShape]]) -> ModelRunner:
    """A batch-invariant runner (as the verifier serves) whose arena holds the largest of
    ``batches``, every row random keys and values."""
    rows = max(sum(s.total + 1 + KEY_BLOCK for s in b) for b in batches) + 64  # slots round up to whole blocks
    runner = ModelRunner(loaded, rows * kv_shape(loaded.model).bytes_per_token, "auto", batch_invariant=True)
    runner.kv.data.normal_(generator=torch.Generator(device=runner.device).manual_seed(0))
    return runner


def time_batch(runner: ModelRunner, shapes: Sequence[SegmentShape], timed: int = 1) -> float:
    """Seconds of one forward over ``shapes``, after an untimed one of the same shape (the median
    of ``timed`` such forwards)."""
    slots = [runner.kv.allocate(max(1, s.total)) for s in shapes]
    try:
        segments = []
        for slot, shape in zip(slots, shapes, strict=True):
            assert slot is not None, "the profile's KV arena is too small"
            slot.length = shape.cached  # the context: rows of random keys and values
            logits_from = shape.new if shape.new > MAX_VERIFY_NEW else 0
            segments.append(Segment(slot, [1 + i % 7 for i in range(shape.new)], logits_from))
        times = []
        for _ in range(WARMUP + timed):
            start = time.perf_counter()
            runner.forward(segments)
            if runner.device.type == "cuda":  # the forward's kernels, not only their launch
                torch.cuda.synchronize(runner.device)
            times.append(time.perf_counter() - start)
            for seg, shape in zip(segments, shapes, strict=True):
                seg.slot.truncate(shape.cached)
        return statistics.median(times[WARMUP:])
    finally:
        for slot in slots:
            if slot is not None:
                runner.kv.free(slot)


def measure(
    runner: ModelRunner, batches: Sequence[list[SegmentShape]], repeats: int, progress: bool = True
) -> list[Sample]:
    """Median seconds per batch over ``repeats`` passes through all of them (a burst of load from
    another process then spoils one repeat of several shapes, not every repeat of one shape)."""
    for _ in range(3):  # warm the allocator and the kernels up before the first timed shape
        time_batch(runner, batches[0])
    times: list[list[float]] = [[] for _ in batches]
    with tqdm(
        total=repeats * len(batches), desc="profile verifier", unit="forward", disable=not progress, dynamic_ncols=True
    ) as bar:
        for _ in range(repeats):
            for shapes, seen in zip(batches, times, strict=True):
                seen.append(time_batch(runner, shapes))
                bar.update()
    return [(shapes, statistics.median(seen)) for shapes, seen in zip(batches, times, strict=True)]


#: the start-up calibration's batch shapes: sessions x cached rows x tokens fed each; each timed
#: this many times, the median taken (one host's memory bandwidth moves from second to second)
CALIBRATION = ((1, 2, 4, 8), (32, 256), (1, 5))
CALIBRATION_REPEATS = 3


def calibration_batches(max_len: int, free_rows: int) -> list[list[SegmentShape]]:
    """The :data:`CALIBRATION` grid's homogeneous batches that fit the model's context and ``free_rows``
    of the KV arena (each session holds its context, its new tokens and one spare row)."""
    sizes, contexts, news = CALIBRATION
    batches = [[_shape(ctx, new, max_len)] * size for size in sizes for ctx in contexts for new in news]
    return [b for b in batches if sum(s.total + 1 for s in b) <= free_rows]


def calibrate(runner: ModelRunner, estimator: StepTimeEstimator, max_len: int) -> float:
    """Seed ``estimator`` with forwards timed on the serving runner before it serves (the median of
    :data:`CALIBRATION_REPEATS` timed forwards after an untimed one, per shape of
    :func:`calibration_batches`; about 4 s on the default target on one core). Returns the seconds
    it took; ValueError when the arena or the context leaves too few shapes to fit (the estimator
    keeps its coefficients)."""
    started = time.perf_counter()
    batches = calibration_batches(max_len, runner.kv.tokens)
    if batches:  # the contexts read zeros, not the fresh arena's leftover bytes; then warm the kernels up
        runner.kv.data[..., : max(sum(s.total + 1 for s in b) for b in batches), :].zero_()
        time_batch(runner, batches[0])
    estimator.seed([(shapes, time_batch(runner, shapes, CALIBRATION_REPEATS)) for shapes in batches])
    return time.perf_counter() - started


def split(samples: Sequence[Sample], test_share: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """A random ``1 - test_share`` / ``test_share`` split (at least one batch held out)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = max(1, round(test_share * len(samples)))
    return [samples[i] for i in order[held:]], [samples[i] for i in order[:held]]


def table(train: FitReport, test: FitReport, coef: Sequence[float]) -> str:
    a, b, c, d = coef
    lines = [
        "            R²     MAPE      n",
        f"train   {train.r2:7.4f}  {100 * train.mape:5.1f} %  {train.n:5d}",
        f"test    {test.r2:7.4f}  {100 * test.mape:5.1f} %  {test.n:5d}",
        f"T = {1e6 * a:.2f} µs·ΣL_new + {1e9 * b:.3f} ns·Σ(L_total·L_new) + {1e9 * c:.2f} ns·ΣL_cached "
        f"+ {1e3 * d:.3f} ms",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    count = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    repeats = args.repeats or (3 if args.quick else 7)
    batches = plan_batches(args.max_batch, count, loaded.max_model_len, args.seed)
    runner = make_runner(loaded, batches)
    samples = measure(runner, batches, repeats)
    train, test = split(samples, 0.2, args.seed)
    est = StepTimeEstimator(fit(train))
    train_report, test_report = evaluate(est, train), evaluate(est, test)
    elapsed = time.perf_counter() - started
    extra = {
        "train": asdict(train_report),
        "test": asdict(test_report),
        "runner": runner.kind,
        "threads": args.threads,
        "repeats": repeats,
        "batches": len(samples),
        "max_batch": args.max_batch,
        "seconds": round(elapsed, 1),
    }
    est.save(args.out, report=test_report, model=loaded.path, extra=extra)
    print(
        f"verifier step time, {loaded.name} ({runner.kind} runner, {args.threads} thread(s)), {len(samples)} batches "
        f"x {repeats} repeats, fit on {train_report.n}, held out {test_report.n}:"
    )
    print(table(train_report, test_report, est.coef))
    print(f"wrote {args.out} in {elapsed:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.verifier.profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".specfleet/models/smollm2-135m-instruct",
                   help="the target model directory (specfleet fetch-model makes the default)")
    p.add_argument("--out", default=".specfleet/verifier-profile.json", help="the estimator JSON to write")
    p.add_argument(
        "--repeats", type=int, default=0, help="timed passes over all batches, median taken (default 7; 3 quick)"
    )
    p.add_argument("--max-batch", type=int, default=32, help="most verification sessions in one batch")
    p.add_argument(
        "--batches", type=int, default=0, help=f"batch shapes to time (default {BATCHES}; {QUICK_BATCHES} with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (under a minute on 2 CPU cores)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (as the verifier's --torch-threads)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_batch < 1 or args.repeats < 0 or args.batches < 0 or args.threads < 1:
        p.error("--max-batch and --threads must be >= 1, --repeats and --batches >= 0")
    if not (Path(args.model) / "config.json").is_file():
        print(
            f"error: no model at {args.model} (no config.json there). Fetch the default target with "
            "`specfleet fetch-model`, or pass --model DIR for another local Hugging Face model.",
            file=sys.stderr,
        )
        return 2
    try:
        return run(args)
    except (ModelLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
