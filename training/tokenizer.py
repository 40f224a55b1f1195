"""A byte-level BPE fitted on the training split, saved with specfleet's chat template.

Byte-level means any text round-trips (no unknown tokens); the special tokens and template are
``shared.models``' so ``/v1/chat/completions`` renders prompts the same way for every model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shared.models import train_bpe
from training.corpus import DOMAINS, SPLITS, read_corpus


def _training_texts(corpus: Path, limit_bytes: int) -> Iterator[str]:
    """Training-split documents, docs first (small) then code, up to limit_bytes in total."""
    total = 0
    for domain in ("docs", "code"):
        for row in read_corpus(corpus, split="train", domain=domain):
            yield row["text"]
            total += len(row["text"])
            if total >= limit_bytes:
                return


def train_tokenizer(corpus: Path, out_dir: Path, vocab_size: int, limit_bytes: int) -> Any:
    """Fit the BPE and save it (tokenizer.json + config with chat template) into out_dir."""
    return train_bpe(_training_texts(corpus, limit_bytes), out_dir, vocab_size, show_progress=True)


def encode_corpus(corpus: Path, tokenizer: Any, out_dir: Path) -> dict[str, int]:
    """Token streams per split and domain (uint16 .npy), documents joined by the eos token."""
    eos = int(tokenizer.eos_token_id)
    sizes: dict[str, int] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for domain in DOMAINS:
            texts = [row["text"] for row in read_corpus(corpus, split=split, domain=domain)]
            ids: list[int] = []
            encoded_all = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
            for encoded in encoded_all:
                ids.extend(encoded)
                ids.append(eos)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(out_dir / f"{split}_{domain}.npy", arr)
            sizes[f"{split}_{domain}"] = int(arr.size)
    return sizes


def load_tokens(tokens_dir: Path, split: str, domain: str) -> np.ndarray:
    return np.load(tokens_dir / f"{split}_{domain}.npy")
