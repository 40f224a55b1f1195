"""The token that most often follows each token pair, and each token, in a corpus of the target's
answers: looked-up rows where prompt lookup finds no earlier match.

A draft model's step on an edge CPU reads every weight whatever its rows, so a second row costs
little (specfleet's 4-bit kernel works in tiles of two rows: on the EPYC a step of two sessions took
5.09 against 5.12 ms for one at 20 tokens of context, 6.41 against 5.76 at 200,
``bench/results/epyc/draft-steps-rows``). Prompt lookup (``ngram.lookup``) fills that row
where the session's text repeats itself. This table fills it at most of the rest: the commonest
continuation of the last two tokens (backing off to the last one) in the target's own answers to the
training prompts (``training/data/<target>/train.jsonl.gz``). Over the target's answers to 24 held-out
chat prompts (``python -m bench draft-rounds``, ``bench/results/epyc/draft-rounds``): lookup guesses at
0.19 of the positions, the table at 0.79, right at 0.42 of its guesses; drafting alone, teacher-forced,
a committed token took 0.670 forwards with both against 0.814 with lookup alone (4.20 against 4.81 ms).
A guess only decides which row is fed: a kept guess is exactly the token the draft model
drafts there, so the table changes speed, never a draft.

``specfleet fetch-model`` writes it beside the target's GGUF copies as ``<target>.next-tokens.json``
(``write_table``); a drafter finds it there (``table_beside``).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from shared.errors import ModelLoadError

FORMAT = "specfleet-next-tokens-1"
SUFFIX = ".next-tokens.json"


class NextTokens:
    """``guess(context)``: the commonest token after the context's last pair, else after its last
    token, else None."""

    def __init__(self, pairs: dict[tuple[int, int], int], singles: dict[int, int]) -> None:
        self.pairs = pairs
        self.singles = singles

    def __len__(self) -> int:
        return len(self.pairs) + len(self.singles)

    def largest_id(self) -> int:
        """The largest token id the table holds (-1 when empty): a draft must have it in its vocabulary."""
        ids = [max(a, b, t) for (a, b), t in self.pairs.items()] + [max(a, t) for a, t in self.singles.items()]
        return max(ids, default=-1)

    def guess(self, context: Sequence[int]) -> int | None:
        if len(context) >= 2 and (token := self.pairs.get((context[-2], context[-1]))) is not None:
            return token
        return self.singles.get(context[-1]) if context else None

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], min_pair_count: int = 2) -> NextTokens:
        """The commonest follower of every pair seen at least ``min_pair_count`` times, and of every
        token (ties: the smaller id, so a table is the same from the same corpus)."""
        pairs: defaultdict[tuple[int, int], Counter[int]] = defaultdict(Counter)
        singles: defaultdict[int, Counter[int]] = defaultdict(Counter)
        for seq in sequences:
            for i in range(1, len(seq)):
                singles[seq[i - 1]][seq[i]] += 1
                if i >= 2:
                    pairs[(seq[i - 2], seq[i - 1])][seq[i]] += 1
        return cls({k: _commonest(c) for k, c in pairs.items() if c.total() >= min_pair_count},
                   {k: _commonest(c) for k, c in singles.items()})

    def to_json(self) -> dict[str, object]:
        return {"format": FORMAT,
                "pairs": [[a, b, t] for (a, b), t in sorted(self.pairs.items())],
                "singles": [[a, t] for a, t in sorted(self.singles.items())]}

    @classmethod
    def from_json(cls, data: dict[str, object], where: str) -> NextTokens:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelLoadError(f"{where} is not a next-token table ({FORMAT}); remake it with `specfleet "
                                 "fetch-model`")
        try:
            pairs = {(int(a), int(b)): int(t) for a, b, t in data["pairs"]}  # type: ignore[attr-defined]
            singles = {int(a): int(t) for a, t in data["singles"]}  # type: ignore[attr-defined]
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{where}: a malformed next-token table ({exc}); remake it with `specfleet "
                                 "fetch-model`") from None
        if any(min(pair) < 0 or t < 0 for pair, t in pairs.items()) or any(min(a, t) < 0 for a, t in singles.items()):
            raise ModelLoadError(f"{where}: a malformed next-token table (a negative token id); remake it with "
                                 "`specfleet fetch-model`")
        return cls(pairs, singles)


def _commonest(counts: Counter[int]) -> int:
    return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]


def read_answers(path: Path) -> list[list[int]]:
    """The ``answer`` token ids of each line of a teacher-answers file (``training/data``'s format)."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
        return [[int(t) for t in json.loads(line)["answer"]] for line in f if line.strip()]


def write_table(answers: Path, out: Path) -> NextTokens:
    """Build the table from a teacher-answers file and write it to ``out`` (atomically)."""
    table = NextTokens.build(read_answers(answers))
    tmp = out.with_name(f"{out.name}.{os.getpid()}.partial")  # two processes may make it at once
    tmp.write_text(json.dumps(table.to_json(), separators=(",", ":")))
    tmp.chmod(0o644)
    tmp.replace(out)
    return table


def table_beside(draft: Path) -> Path:
    """Where a GGUF copy's table lies: ``<dir>/<target>.<WIDTH>.gguf`` -> ``<dir>/<target>.next-tokens.json``
    (a width such as Q4_1, Q8_0, IQ4_NL, F16; a file with none, ``target.gguf``, keeps its whole stem)."""
    stem = re.sub(r"\.gguf$", "", draft.name, flags=re.IGNORECASE)
    stem = re.sub(r"\.(I?Q\d\w*|B?F16|F32)$", "", stem, flags=re.IGNORECASE)
    return draft.with_name(stem + SUFFIX)


def load_table(path: Path) -> NextTokens:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not text at all (a GGUF given by mistake)
        raise ModelLoadError(f"cannot read the next-token table {path}: {exc}") from None
    return NextTokens.from_json(data, str(path))
