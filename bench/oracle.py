"""Greedy references for the oracle drafter (``--proposer oracle``): ``python -m bench oracle-record``.

A target-only fleet serves each prompt greedily; its output token ids, as the client received
them, are the reference the oracle then proposes from (``services/drafter/proposers/oracle.py``).
Prompts are token ids, so the oracle sees exactly the prompt it was recorded for.

    python -m bench oracle-record --target DIR [--prompts 64] [--prompt-len 32] [--max-tokens 128] --out refs.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import websockets
from tqdm import tqdm

from bench.edge import Edge
from bench.fleets import Scenario, bench_fleet


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn from the vocabulary's upper part (no special tokens)."""
    rng = random.Random(seed)
    low = min(16, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(n)]


def greedy_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    """A greedy completion of ``max_tokens`` (end tokens ignored), the prompt as text or token ids."""
    return {"kind": "completion", "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}


async def stream_ids(ws_url: str, bodies: list[dict[str, Any]], concurrency: int,
                     progress: tqdm | None = None) -> list[list[int]]:
    """Every body's generated token ids, in body order, over ``concurrency`` sockets."""
    out: list[list[int]] = [[] for _ in bodies]
    todo = list(reversed(range(len(bodies))))

    async def worker() -> None:
        async with websockets.connect(ws_url, max_size=None) as ws:
            while todo:
                i = todo.pop()
                await ws.send(json.dumps(bodies[i]))
                while (frame := json.loads(await ws.recv()))["type"] != "done":
                    if frame["type"] != "token":
                        raise RuntimeError(f"request {i} failed: {frame}")
                    out[i] += frame["token_ids"]
                if progress is not None:
                    progress.update()

    await asyncio.gather(*[worker() for _ in range(min(concurrency, len(bodies)))])
    return out


def write_references(path: Path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for prompt, output in zip(prompts, outputs, strict=True):
            f.write(json.dumps({"prompt_ids": prompt, "output_ids": output}) + "\n")


def record(ws_url: str, model: str, prompts: list[list[int]], max_tokens: int, out: Path,
           concurrency: int = 16) -> list[list[int]]:
    """Serve ``prompts`` greedily on a running (target-only) fleet and write the reference file."""
    with tqdm(total=len(prompts), desc="recording greedy references", unit="prompt") as bar:
        outputs = asyncio.run(stream_ids(ws_url, [greedy_body(model, p, max_tokens) for p in prompts],
                                         concurrency, bar))
    write_references(out, prompts, outputs)
    return outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench oracle-record", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="the target model directory")
    p.add_argument("--out", type=Path, required=True, help="the reference file to write (JSON lines)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", help="the verifier's --device")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from shared.models import load_vocabulary

    vocab = load_vocabulary(args.target).vocab_size
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, args.seed)
    scenario = Scenario("target-only", verifier_flags=("--device", args.device))
    with tempfile.TemporaryDirectory() as logs, bench_fleet(args.target, scenario, Edge("", ""), Path(logs)) as bf:
        record(bf.fleet.ws_url, args.target.name, prompts, args.max_tokens, args.out)
    print(f"wrote {len(prompts)} greedy references to {args.out}")
    return 0
