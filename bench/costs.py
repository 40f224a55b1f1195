"""Raw model costs, measured with nothing around the model (run pinned by the benchmarks).

    python -m bench.costs --model .specfleet/models/smollm2-135m-instruct --decode 128 --shapes 1x128x1,1x128x5,16x128x5

prints one JSON object:

* ``hf_decode_tok_s``: a plain transformers greedy loop with its KV cache (DynamicCache), the
  "raw decode rate" of the model, and ``runner_decode_tok_s``: the same loop on specfleet's
  model runner (arena KV cache, lean forward);
* ``forward_ms``: the median time of one runner forward for each shape ``BxCxN`` (B sessions,
  C tokens of cached context each, N new tokens each), and ``hf_forward_ms`` for the same
  shapes through transformers with a padded DynamicCache;
* with ``--draft-batches 1,2,4,8,16`` (``--model`` a draft model): ``draft_batch_ms``, the
  draft-model proposer's greedy drafting batch of ``--draft-len`` tokens per session at each
  batch size, and its fit per forward, ``draft_forward_ms + rows·draft_row_ms``, with the fixed
  cost in rows' worth, ``draft_forward_rows``;
* with ``--assistant DRAFT``: ``hf_generate_tok_s`` and ``hf_assisted_tok_s``, transformers'
  own ``generate`` greedy, alone and with the draft as ``assistant_model`` (Hugging Face's
  assisted generation, on the same pair and the same CPU), over ``--decode`` tokens;
* with ``--floor``: ``floor``, the physical floor of one decode step on this core, in the weights'
  dtype: the bytes a decode step streams (every matrix once; a tied head is the embedding, an
  untied embedding table is read a row at a time and not counted) over the bandwidth of a 1-row
  matmul (GEMV) streaming 256 MiB of weights of the model's width, which no cache holds; and
  ``matmuls_tok_s``: the lean runner's own matmuls alone, every weight matrix once on one row,
  with no other op between them (the most a decode step can reach with these kernels).

Every number is a median over repeats, after warm-up, with one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from shared.models import load_model
from shared.runner import ModelRunner, Segment, rowwise
from shared.runner.invariant import KEY_BLOCK
from shared.runner.lean import LeanDecoder
from shared.runner.matmul import Matmul, packing_available, resolve_kernel

WARMUP = 3


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def hf_decode(model: Any, prompt: list[int], tokens: int) -> float:
    """Tokens/s of plain transformers greedy decoding with its own KV cache."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - start)


def runner_decode(runner: ModelRunner, prompt: list[int], tokens: int) -> float:
    """Tokens/s of the same greedy loop on the runner (the model part of target-only serving)."""
    slot = runner.kv.allocate(len(prompt) + tokens + 1)
    assert slot is not None
    try:
        runner.forward([Segment(slot, prompt[:-1], len(prompt) - 1)])
        token = prompt[-1]
        start = time.perf_counter()
        for _ in range(tokens):
            logits = runner.forward([Segment(slot, [token], 0)])
            assert logits is not None
            token = int(logits[0].argmax())
        return tokens / (time.perf_counter() - start)
    finally:
        runner.kv.free(slot)


def runner_forward_ms(runner: ModelRunner, batch: int, context: int, new: int, repeats: int) -> float:
    """Median time of one forward over ``batch`` sessions x ``new`` tokens after ``context`` cached."""
    slots = [runner.kv.allocate(context + new + 1) for _ in range(batch)]
    assert all(s is not None for s in slots), "the benchmark's KV arena is too small"
    gen = torch.Generator().manual_seed(0)
    try:
        for slot in slots:
            assert slot is not None
            if context:
                ids = torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist()
                runner.forward([Segment(slot, ids, context)])
        segments = [Segment(s, [1] * new, 0) for s in slots if s is not None]

        def step() -> None:
            runner.forward(segments)
            for seg in segments:
                seg.slot.truncate(context)

        return median_ms(step, repeats)
    finally:
        for slot in slots:
            if slot is not None:
                runner.kv.free(slot)


@torch.inference_mode()
def hf_forward_ms(model: Any, batch: int, context: int, new: int, repeats: int) -> float:
    """The same step through transformers: a padded batch and its DynamicCache (for contrast)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    cache = model(input_ids=ids, use_cache=True).past_key_values
    x = torch.ones((batch, new), dtype=torch.long)
    positions = torch.arange(context, context + new).expand(batch, new)
    mask = torch.ones((batch, context + new), dtype=torch.long)

    def step() -> None:
        model(input_ids=x, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache.crop(-new)

    return median_ms(step, repeats)


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], tokens: int, assistant: Any = None) -> float:
    """Tokens/s of transformers' greedy ``generate`` over ``prompts`` (with ``assistant_model``:
    Hugging Face's assisted generation)."""
    extra = {"assistant_model": assistant} if assistant is not None else {}
    made, start = 0, time.perf_counter()
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             **extra)
        made += out.shape[1] - len(prompt)
    return made / (time.perf_counter() - start)


def draft_batch_ms(loaded: Any, rows: list[int], k: int, prompt_len: int, repeats: int) -> dict[int, float]:
    """Median milliseconds of one greedy drafting batch of the draft-model proposer (what a drafter
    runs per batch: ``k`` forwards, sampling and its cache bookkeeping) for each batch size in
    ``rows``; after each batch, untimed (the drafter commits apart from its batches), every session
    commits up to 2 of its drafts and a bonus token."""
    from services.drafter.proposers.base import DraftJob, JobSession
    from services.drafter.proposers.draft_model import DraftModelProposer
    from shared.protocol import MAX_DRAFT_TOKENS, SamplingParams
    from shared.sampling import make_generator

    new = (WARMUP + repeats) * 3 + k
    tokens = 2 * max(rows) * (prompt_len + new + MAX_DRAFT_TOKENS)  # room for every session, and its spares
    proposer = DraftModelProposer(ModelRunner(loaded, tokens * kv_bytes(loaded), "auto"), loaded.eos_ids)
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    out = {}
    for n in rows:
        ids = [f"b{n}-{i}" for i in range(n)]
        for i, sid in enumerate(ids):
            proposer.start(sid, [5 + (i + j) % 200 for j in range(prompt_len)], new)
        jobs = [DraftJob(JobSession(sid, params, make_generator(i, "draft")), k) for i, sid in enumerate(ids)]
        times = [_draft_and_commit(proposer, jobs, n * k) for _ in range(WARMUP + repeats)]
        out[n] = 1e3 * statistics.median(times[WARMUP:])
        for sid in ids:
            proposer.close(sid)
    return out


def _draft_and_commit(proposer: Any, jobs: list[Any], tokens: int) -> float:
    """One batch, timed; then every session commits up to 2 drafts and a bonus token. Raises when the
    batch drafted fewer than ``tokens`` (a session the arena had no room for drafts nothing)."""
    started = time.perf_counter()
    proposals = proposer.propose(jobs)
    seconds = time.perf_counter() - started
    if sum(len(p.token_ids) for p in proposals) != tokens:
        raise RuntimeError(f"a batch of {len(jobs)} sessions drafted fewer than {tokens} tokens")
    for job, proposal in zip(jobs, proposals, strict=True):
        kept = list(proposal.token_ids[:2])
        proposer.commit(job.session_id, [*kept, 5], len(kept))
    return seconds


def draft_costs(loaded: Any, rows: list[int], k: int, prompt_len: int, repeats: int) -> dict[str, Any]:
    """:func:`draft_batch_ms` and its fit per forward: ms = fixed + rows·per_row, and the fixed
    cost in rows' worth (``draft_forward_rows``, the simulator's validation takes it)."""
    ms = draft_batch_ms(loaded, rows, k, prompt_len, repeats)
    fixed, per_row = fit_line([float(n) for n in ms], [t / k for t in ms.values()]) if len(ms) > 1 else (0.0, 0.0)
    return {"draft_batch_ms": ms, "draft_forward_ms": fixed, "draft_row_ms": per_row,
            "draft_forward_rows": max(0.0, fixed) / per_row if per_row > 0 else 0.0}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def parse_shape(text: str) -> tuple[int, int, int]:
    b, c, n = (int(x) for x in text.lower().split("x"))
    return b, c, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.costs", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--decode", type=int, default=0, help="tokens of greedy decoding to time (0: skip)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--shapes", default="", help="comma list of BxCxN forward shapes")
    p.add_argument("--hf-shapes", action="store_true", help="also time the shapes through transformers")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--assistant", default="", help="a draft model: also time HF assisted generation with it")
    p.add_argument("--prompt-text", action="append", default=[], help="prompt(s) for --assistant (repeatable)")
    p.add_argument("--draft-batches", default="", help="comma list of batch sizes: time the draft-model "
                   "proposer's greedy batches (--model a draft model) and fit a forward's fixed cost and cost per row")
    p.add_argument("--draft-len", type=int, default=4, help="tokens each session drafts per batch (--draft-batches)")
    p.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (as the verifier's --dtype)")
    p.add_argument("--batch-invariant", action="store_true", help="the runner batch-invariant, as the verifier serves")
    p.add_argument("--matmul", default="auto", help="the runner's matmul kernel (the verifier's --matmul)")
    p.add_argument("--no-fuse", action="store_true", help="run each block as torch ops, not one C++ call (the "
                   "runner's fused blocks: shared.runner.lean.fused_reason)")
    p.add_argument("--floor", action="store_true", help="also measure the decode floor: weight bytes over a GEMV's "
                   "bandwidth on this core")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model(args.model, dtype=args.dtype)
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    need = max([b * (c + n + 1 + KEY_BLOCK) for b, c, n in shapes] + [args.prompt_len + args.decode + 1]) + 64
    runner = ModelRunner(loaded, need * kv_bytes(loaded), "auto", batch_invariant=args.batch_invariant,
                         matmul=args.matmul, fuse=not args.no_fuse)
    prompt = list(range(5, 5 + args.prompt_len))
    out: dict[str, Any] = {"model": args.model, "runner": runner.kind, **runner.describe(),
                           "kernels": [k for k in ("rowwise", "onednn") if _runs(k, runner.weight_dtype)]}
    if args.floor:
        out["floor"] = floor(loaded.model, args.repeats)
        if isinstance(runner.decoder, LeanDecoder):
            out["matmuls_tok_s"] = 1e3 / matmuls_ms(runner.decoder.matmuls(), args.repeats)
    if args.decode:
        out["hf_decode_tok_s"] = statistics.median(hf_decode(loaded.model, prompt, args.decode) for _ in range(3))
        out["runner_decode_tok_s"] = statistics.median(runner_decode(runner, prompt, args.decode) for _ in range(3))
    out["forward_ms"] = {f"{b}x{c}x{n}": runner_forward_ms(runner, b, c, n, args.repeats) for b, c, n in shapes}
    if args.draft_batches:
        out.update(draft_costs(loaded, [int(n) for n in args.draft_batches.split(",")], args.draft_len,
                               args.prompt_len, args.repeats))
    if args.hf_shapes:
        out["hf_forward_ms"] = {f"{b}x{c}x{n}": hf_forward_ms(loaded.model, b, c, n, args.repeats)
                                for b, c, n in shapes}
    if args.assistant and args.decode:
        assistant = load_model(args.assistant).model
        texts = [loaded.tokenizer(t)["input_ids"] for t in args.prompt_text] or [prompt]
        hf_generate(loaded.model, texts[:1], 8, assistant)  # warm-up
        out["hf_generate_tok_s"] = hf_generate(loaded.model, texts, args.decode)
        out["hf_assisted_tok_s"] = hf_generate(loaded.model, texts, args.decode, assistant)
    print(json.dumps(out))
    return 0


@torch.inference_mode()
def floor(model: Any, repeats: int, stream_bytes: int = 256 << 20) -> dict[str, Any]:
    """The decode floor: weight bytes over a GEMV's bandwidth, in the weights' dtype, on this core."""
    params = {p.data_ptr(): p for p in model.parameters()}  # a tied head counts once
    embed = model.get_input_embeddings().weight
    if embed.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        params.pop(embed.data_ptr())  # an untied table is read one row per token, not streamed
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    dtype = next(model.parameters()).dtype
    width = model.config.hidden_size
    rows = stream_bytes // (width * torch.tensor([], dtype=dtype).element_size())
    weight, x = torch.randn(rows, width).mul_(0.02).to(dtype), torch.randn(1, width).to(dtype)
    # the fastest of the plain matmul, oneDNN's on its reordered weight and specfleet's row-wise
    # kernel on its packed one (shared.runner.matmul)
    ways = {"F.linear": Matmul(weight, None, "plain")}
    if packing_available(weight.device, dtype):
        ways["oneDNN, reordered weight"] = Matmul(weight, None, "onednn")
    if dtype in (torch.float32, torch.bfloat16) and rowwise.available():
        ways["specfleet row-wise"] = Matmul(weight, None, "rowwise")
    gemv_ms, gemv = min((median_ms(lambda m=m: m(x), repeats), name) for name, m in ways.items())  # type: ignore[misc]
    gb_s = weight.numel() * weight.element_size() / gemv_ms / 1e6
    floor_ms = weight_bytes / gb_s / 1e6
    return {"dtype": str(dtype).removeprefix("torch."), "weight_bytes": weight_bytes, "gemv_gb_s": gb_s, "gemv": gemv,
            "floor_ms": floor_ms, "floor_tok_s": 1e3 / floor_ms}


def _runs(kernel: str, dtype: torch.dtype) -> bool:
    try:
        return resolve_kernel(kernel, torch.device("cpu"), dtype) == kernel
    except ValueError:
        return False


@torch.inference_mode()
def matmuls_ms(matmuls: list[Matmul], repeats: int) -> float:
    """Median time of one pass over ``matmuls``, each on one row of random activations."""
    rows = [torch.randn(1, m.in_features) for m in matmuls]

    def one_pass() -> None:
        for m, x in zip(matmuls, rows, strict=True):
            m(x)

    return median_ms(one_pass, repeats)


def kv_bytes(loaded: Any) -> int:
    from shared.runner.runner import kv_shape

    return kv_shape(loaded.model).bytes_per_token


if __name__ == "__main__":
    raise SystemExit(main())
