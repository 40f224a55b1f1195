"""The training corpus: Python standard-library source plus its English docs, split by file.

Both ship with every Python install, so the pipeline needs no download. The held-out split is
decided per file (per docs topic) by a hash of its name, so it is deterministic, independent of
directory order, and no held-out file leaks into training through a shared window.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

#: stdlib folders left out: test suites are mostly fixtures, site-packages is not the stdlib
EXCLUDED_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
DOMAINS = ("code", "docs")
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Document:
    name: str  # stdlib-relative path, or "pydoc_data/topics.py::<topic>" for a docs topic
    domain: str  # "code" or "docs"
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_documents(root: Path | None = None) -> Iterator[Document]:
    """Every stdlib ``.py`` file outside test suites, in sorted path order."""
    root = root or stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_PARTS & set(rel.parts) or rel.parts[0] == "pydoc_data":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield Document(rel.as_posix(), "code", text)


def docs_documents() -> Iterator[Document]:
    """Each topic of ``pydoc_data/topics.py`` (the English language reference) as one document.

    Topics are framed as a chat turn in specfleet's template (``chat_turn``), so the models see the
    role tokens that ``/v1/chat/completions`` prompts are made of and answer in prose after them.
    """
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            question = f"What does the Python language reference say about {key}?"
            yield Document(f"pydoc_data/topics.py::{key}", "docs", chat_turn(question, text))


def chat_turn(user: str, assistant: str) -> str:
    """One user/assistant exchange exactly as ``shared.models.CHAT_TEMPLATE`` renders it."""
    return f"<|user|>\n{user}<|end|>\n<|assistant|>\n{assistant}<|end|>\n"


def split_of(name: str, heldout_percent: int) -> str:
    """'heldout' for about heldout_percent % of names, chosen by hash so it never depends on order."""
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < heldout_percent else "train"


def build_corpus(out_path: Path, heldout_percent: int, docs: Iterable[Document] | None = None) -> dict[str, int]:
    """Write every document as a JSON line with its split; return document counts per split/domain."""
    counts: dict[str, int] = {}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    source = docs if docs is not None else _all_documents()
    with tmp.open("w", encoding="utf-8") as fh:
        for doc in source:
            split = split_of(doc.name, heldout_percent)
            fh.write(json.dumps({**asdict(doc), "split": split}, ensure_ascii=False) + "\n")
            key = f"{split}_{doc.domain}"
            counts[key] = counts.get(key, 0) + 1
    tmp.replace(out_path)
    return counts


def read_corpus(path: Path, split: str | None = None, domain: str | None = None) -> Iterator[dict[str, str]]:
    """The corpus' JSON lines, optionally only one split and/or domain."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if (split is None or row["split"] == split) and (domain is None or row["domain"] == domain):
                yield row


def _all_documents() -> Iterator[Document]:
    yield from code_documents()
    yield from docs_documents()
