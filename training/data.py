"""The teacher's answers on disk: made once, committed as token ids, read back as sequences.

``training/data/<target>/{train,heldout}.jsonl.gz`` holds one ``{"id", "mode", "answer"}`` line per
prompt. Generating them is the slow part of the pipeline (the target decodes every answer), so
they are committed; everything after them (the teacher's top-k distributions, the drafts) is
remade from them. The prompts themselves are not stored: ``training.prompts`` rebuilds them
from the seed, and the target's chat template renders them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from training.prompts import Prompt
from training.teacher import chat_ids, read_answers
from training.teacher_logits import Sequence


def committed_path(data_dir: Path, target_name: str, split: str) -> Path:
    return data_dir / target_name / f"{split}.jsonl.gz"


def read_committed(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_committed(records: list[dict[str, Any]], path: Path) -> None:
    """Deterministic bytes (no timestamp in the gzip header), so a re-run does not dirty the tree."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(body)
    tmp.replace(path)


def load_answers(data_dir: Path, state_dir: Path, target_name: str, split: str) -> list[dict[str, Any]]:
    """The committed answers if there are any, else those generated in the state directory."""
    committed = committed_path(data_dir, target_name, split)
    if committed.exists():
        return read_committed(committed)
    return read_answers(state_dir / "teacher" / f"{split}.jsonl")


def sequences(records: list[dict[str, Any]], prompts: list[Prompt], tokenizer: Any) -> list[Sequence]:
    """Each answer with its prompt rendered as serving renders it; answers of unknown prompts are an error."""
    by_id = {p.id: p for p in prompts}
    missing = [r["id"] for r in records if r["id"] not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} answers belong to no prompt of this seed (first: {missing[0]}); the "
                         "prompt grid changed since they were made: regenerate them")
    return [Sequence(r["id"], chat_ids(tokenizer, by_id[r["id"]].text), [int(t) for t in r["answer"]])
            for r in records if r["answer"]]
