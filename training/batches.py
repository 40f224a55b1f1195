"""Training and evaluation windows cut from the token streams.

A training batch depends only on (seed, step), never on what ran before, so a resumed run sees
exactly the batches an uninterrupted one would have seen.
"""

from __future__ import annotations

import numpy as np
import torch


class WindowSampler:
    """Random windows of seq_len + 1 tokens, drawn from code or (with docs_weight) docs."""

    def __init__(self, code: np.ndarray, docs: np.ndarray, seq_len: int, docs_weight: float, seed: int) -> None:
        for name, stream in (("code", code), ("docs", docs)):
            if stream.size <= seq_len + 1:
                raise ValueError(f"the {name} token stream ({stream.size} tokens) is shorter than one window")
        self.streams = (code, docs)
        self.seq_len = seq_len
        self.docs_weight = docs_weight
        self.seed = seed

    def batch(self, step: int, size: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        rows = []
        for use_docs in rng.random(size) < self.docs_weight:
            stream = self.streams[int(use_docs)]
            start = int(rng.integers(0, stream.size - self.seq_len - 1))
            rows.append(stream[start : start + self.seq_len + 1].astype(np.int64))
        return torch.from_numpy(np.stack(rows))


def eval_windows(stream: np.ndarray, count: int, seq_len: int) -> torch.Tensor:
    """count non-overlapping windows of seq_len + 1 tokens spread evenly over a held-out stream."""
    span = seq_len + 1
    available = stream.size // span
    if available < 1:
        raise ValueError(f"held-out stream of {stream.size} tokens is shorter than one {span}-token window")
    picks = np.linspace(0, available - 1, num=min(count, available)).astype(np.int64)
    return torch.from_numpy(np.stack([stream[i * span : (i + 1) * span].astype(np.int64) for i in picks]))
