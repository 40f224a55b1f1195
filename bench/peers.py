"""The systems a user would run instead of specfleet, one request at a time, in a pinned child.

    python -m bench.peers --peer hf-assisted --model TARGET --prompts FILE [--draft DIR] [--gguf FILE]

``--prompts`` is a JSON list of prompts as token ids (the target's chat template already applied,
so every peer decodes the very same ids). Each prompt is answered greedily, one at a time, until
the model's end-of-sequence token or ``--max-tokens``, after one warm-up answer. The peers:

* ``hf``: transformers' own ``generate``, the target alone;
* ``hf-assisted``: transformers' assisted generation with ``--draft`` as ``assistant_model``
  (its own schedule of draft lengths);
* ``hf-lookup``: transformers' prompt lookup (``prompt_lookup_num_tokens``);
* ``vllm``, ``vllm-ngram``: vLLM's CPU backend, offline, target-only and with its own n-gram
  speculation, stepped request by request through its engine so each token's time is seen;
* ``llamacpp``: llama.cpp (``llama-cpp-python``) running ``--gguf`` alone, greedy: a different,
  4-bit model, for reference.

Each token's arrival is timed, so every answer gives its time to first token and its mean time per
output token after the first, as the fleets' load client measures them. Prints one JSON object:
``outcomes`` (per prompt: tokens, ttft_s, tpot_s, latency_s and the answer's ids), ``wall_s`` and, where the peer
counts it, ``forwards`` (target forwards, or engine steps) and ``drafted``/``accepted``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

PEERS = ("hf", "hf-assisted", "hf-lookup", "vllm", "vllm-ngram", "llamacpp")
#: transformers' assistant for assisted generation: the distilled small draft (it cannot run a GGUF copy)
HF_ASSISTANT = Path("models/draft-small")
#: prompt lookup's draft length: transformers' documented example value
LOOKUP_TOKENS = 10
#: vLLM's n-gram speculation: tokens per draft and the n-gram sizes it matches (its documented example)
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass
class Answer:
    """One prompt's answer as its tokens arrived: ``arrivals`` holds (``perf_counter`` seconds, tokens
    that arrived then); assisted decoding delivers several tokens at once."""

    started: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def arrive(self, ids: Sequence[int]) -> None:
        self.arrivals.append((time.perf_counter(), len(ids)))
        self.ids += ids

    def outcome(self) -> dict[str, Any]:
        tokens = sum(n for _, n in self.arrivals)
        if not self.arrivals:
            return {"tokens": 0, "ttft_s": 0.0, "tpot_s": 0.0, "latency_s": 0.0, "ids": []}
        first, last = self.arrivals[0][0], self.arrivals[-1][0]
        after = tokens - self.arrivals[0][1]  # the tokens that arrived after the first arrival
        return {"tokens": tokens, "ttft_s": first - self.started, "tpot_s": (last - first) / after if after else 0.0,
                "latency_s": last - self.started, "ids": self.ids}


def answer_all(prompts: Sequence[Sequence[int]], one: Callable[[Sequence[int], Answer], None],
               after_warmup: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """``one(prompt, answer)`` for a warm-up and then each prompt in turn: the outcomes, the wall
    time and the forwards (each arrival is one: a decode step, or one verification of a draft)."""
    one(prompts[0], Answer(time.perf_counter()))  # warm-up: first calls allocate and pick kernels
    after_warmup()
    answers, began = [], time.perf_counter()
    for prompt in prompts:
        answers.append(Answer(time.perf_counter()))
        one(prompt, answers[-1])
    return {"outcomes": [a.outcome() for a in answers], "wall_s": time.perf_counter() - began,
            "forwards": sum(len(a.arrivals) for a in answers)}


class _Clock:
    """A transformers streamer that timestamps what ``generate`` emits (the prompt first, then each
    verified step's new tokens)."""

    def __init__(self, answer: Answer) -> None:
        self.answer, self.prompt_seen = answer, False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.answer.arrive([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        pass


def hf_peer(peer: str, model: str, draft: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import torch

    from shared.models import load_model

    torch.set_num_threads(1)
    loaded = load_model(model, dtype=dtype)
    extra: dict[str, Any] = {}
    if peer == "hf-assisted":
        extra["assistant_model"] = load_model(draft, dtype=dtype).model
    elif peer == "hf-lookup":
        extra["prompt_lookup_num_tokens"] = LOOKUP_TOKENS

    @torch.inference_mode()
    def one(prompt: Sequence[int], answer: Answer) -> None:
        loaded.model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=sorted(loaded.eos_ids), pad_token_id=min(loaded.eos_ids),
                              streamer=_Clock(answer), **extra)

    return answer_all(prompts, one)


def vllm_peer(peer: str, model: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = {"speculative_config": dict(NGRAM_CONFIG)} if peer == "vllm-ngram" else {}
    llm = LLM(model=model, dtype=cast(Any, dtype), enforce_eager=True, max_model_len=2048, block_size=32, seed=0,
              enable_prefix_caching=False, disable_log_stats=False, **cast(Any, spec))
    engine, params = llm.llm_engine, SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before: dict[str, int] = {}

    def one(prompt: Sequence[int], answer: Answer) -> None:
        engine.add_request(f"r{time.perf_counter_ns()}", TokensPrompt(prompt_token_ids=list(prompt)), params)
        seen = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids = cast(Any, out).outputs[0].token_ids
                if len(ids) > seen:
                    answer.arrive(list(ids[seen:]))
                    seen = len(ids)

    out = answer_all(prompts, one, lambda: before.update(vllm_spec_counts(llm.get_metrics())))
    after = vllm_spec_counts(llm.get_metrics())
    return {**out, **{k: v - before.get(k, 0) for k, v in after.items()}}


def vllm_spec_counts(metrics: Iterable[Any]) -> dict[str, int]:
    """vLLM's speculative counters (drafted and accepted tokens), if it ran speculation."""
    names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    return {names[m.name]: int(m.value) for m in metrics if m.name in names and hasattr(m, "value")}


def llamacpp_peer(gguf: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(gguf, n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
    eos = llm.token_eos()

    def one(prompt: Sequence[int], answer: Answer) -> None:
        llm.reset()  # no prefix reuse from the last answer: every prompt is prefilled, as a new request is
        for made, token in enumerate(llm.generate(list(prompt), top_k=1, temp=0.0, reset=True), start=1):
            answer.arrive([int(token)])
            if token == eos or made >= max_tokens:
                break

    return answer_all(prompts, one)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=PEERS, required=True)
    p.add_argument("--model", required=True, help="the target model directory")
    p.add_argument("--prompts", required=True, help="a JSON file: a list of prompts as token id lists")
    p.add_argument("--draft", default="", help="hf-assisted: the draft model directory")
    p.add_argument("--gguf", default="", help="llamacpp: the GGUF file")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype (hf, vllm)")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    prompts = json.loads(Path(args.prompts).read_text())
    if args.peer.startswith("hf"):
        out = hf_peer(args.peer, args.model, args.draft, args.dtype, prompts, args.max_tokens)
    elif args.peer.startswith("vllm"):
        out = vllm_peer(args.peer, args.model, args.dtype, prompts, args.max_tokens)
    else:
        out = llamacpp_peer(args.gguf, prompts, args.max_tokens)
    print(json.dumps({"peer": args.peer, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
