"""How much of the draft's q to send: acceptance and bytes per round against the nucleus.

    python -m bench qwire            (writes bench/results/qwire.{json,md})

Offline, on the target's own samples at the request's temperature (T = 1 by default): the
target generates continuations of the benchmark prompts; the target and the draft then score
each sequence once, which gives p and q at every generated position. For each nucleus setting
(mass, max entries) this reports

* the expected acceptance per draft token, mean over positions of sum(min(p, q_cut)), where
  q_cut is exactly what the drafter would send and sample from (``shared.draft_q``), and its
  ratio to the full q's;
* the mean entries per position and the bytes of one Draft frame of k positions on the wire.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec
import torch
from tqdm import tqdm

from bench.fleets import PROMPTS, given_args
from shared.draft_q import Nucleus, cut, dense, pack
from shared.models import load_model
from shared.protocol import MAX_Q_ENTRIES, Draft, SamplingParams, encode
from shared.sampling import probs_from_logits

SETTINGS = [(1.0, MAX_Q_ENTRIES), (0.999, MAX_Q_ENTRIES), (0.995, MAX_Q_ENTRIES), (0.99, MAX_Q_ENTRIES),
            (0.98, MAX_Q_ENTRIES), (0.95, MAX_Q_ENTRIES), (0.99, 2048), (0.99, 1024), (0.95, 1024), (0.9, 1024),
            (0.99, 256), (0.99, 64), (1.0, 16)]


@torch.inference_mode()
def rows(target: Any, draft: Any, tokenizer: Any, params: SamplingParams, new_tokens: int,
         seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q rows (after the request's warping) at every position the target generated."""
    torch.manual_seed(seed)
    ps, qs = [], []
    for prompt in tqdm(PROMPTS, desc="target samples", unit="prompt"):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = target.generate(ids, do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id)
        span = slice(ids.shape[1] - 1, out.shape[1] - 1)  # rows that predict the generated tokens
        ps.append(probs_from_logits(target(out).logits[0, span], params))
        qs.append(probs_from_logits(draft(out).logits[0, span], params))
    return torch.cat(ps), torch.cat(qs)


def measure(p: torch.Tensor, q: torch.Tensor, mass: float, entries: int, k: int) -> dict[str, float]:
    accept, sizes, frames = [], [], []
    for p_row, q_row in zip(p, q, strict=True):
        ids, weights = cut(q_row, Nucleus(mass, entries))
        wire = pack(ids, weights)
        accept.append(float(torch.minimum(p_row.double(), dense(wire, q_row.shape[-1]).double()).sum()))
        sizes.append(len(ids))
        frames.append(len(encode(Draft(request_id="r" * 16, round=1, token_ids=[int(ids[0])] * k, q=[wire] * k))))
    n = len(accept)
    return {"mass": mass, "max_entries": entries, "acceptance": sum(accept) / n, "entries": sum(sizes) / n,
            "frame_bytes": sum(frames) / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench qwire", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=".specfleet/models/smollm2-135m-instruct")
    ap.add_argument("--draft", default="models/draft-small")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="draft positions per Draft frame")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = load_model(args.target), load_model(args.draft)
    params = SamplingParams(temperature=args.temperature)
    p, q = rows(target.model, draft.model, target.tokenizer, params, args.new_tokens, seed=0)
    results = [measure(p, q, mass, entries, args.k) for mass, entries in tqdm(SETTINGS, desc="nucleus settings")]
    full = results[0]["acceptance"]
    for r in results:
        r["vs_full_q"] = r["acceptance"] / full
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m bench qwire " + " ".join(given_args(argv)), "positions": p.shape[0],
            "vocab": p.shape[-1], "temperature": args.temperature, "k": args.k, "draft": args.draft}
    (out / "qwire.json").write_bytes(msgspec.json.encode({"meta": meta, "results": results}))
    lines = [f"Command: `{meta['command'].strip()}` ({meta['positions']} positions of the target's own samples at "
             f"T = {args.temperature}; vocabulary {meta['vocab']}; draft {args.draft}; frames of k = {args.k}).", "",
             "| q mass | max entries | acceptance sum(min(p, q)) | vs full q | entries/position | Draft frame bytes |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['mass']} | {r['max_entries']} | {r['acceptance']:.4f} | {r['vs_full_q']:.3f} | "
              f"{r['entries']:.0f} | {r['frame_bytes']:.0f} |" for r in results]
    (out / "qwire.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"written": str(out / "qwire.md")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
