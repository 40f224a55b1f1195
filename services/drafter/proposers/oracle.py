"""A proposer at a controlled acceptance: the target's own greedy continuation, spoiled at rate 1 − α.

For benchmarks and the GPU check, not for serving. A reference file, recorded from a target-only
pass (``bench/oracle_record.py``), holds each prompt's greedy output. For a session whose prompt
is in it, each draft position proposes the reference's token with probability α and a wrong
token otherwise, independently, so a greedy request's drafts are accepted position by position
with probability α until the first wrong one: the acceptance a draft model of that quality would
give, at no model cost. Draws are seeded per (seed, prompt, position): two runs of one
benchmark see the same drafts. A session whose prompt has no reference, or whose committed text
has left it, drafts nothing (its rounds are target-only); so does a sampled request, unless α is
1 (drafts are ids only, lossless at any temperature either way).

Reference file: JSON lines ``{"prompt_ids": [...], "output_ids": [...]}``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.drafter.proposers.base import EMPTY_PROPOSAL, DraftJob, Proposal, ProposerError
from shared.protocol import MAX_DRAFT_TOKENS


@dataclass
class _Session:
    prompt_len: int
    committed: list[int]
    reference: list[int] | None  # the prompt's greedy output (None: no reference)
    key: bytes  # the prompt's digest, for seeding


def load_references(path: Path) -> dict[tuple[int, ...], list[int]]:
    """``{prompt ids: greedy output ids}`` from a reference file (a clear error for a bad one)."""
    refs: dict[tuple[int, ...], list[int]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the oracle's reference file {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            refs[tuple(int(t) for t in row["prompt_ids"])] = [int(t) for t in row["output_ids"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected {{\"prompt_ids\": [...], \"output_ids\": [...]}}: "
                             f"{exc!r}") from None
    if not refs:
        raise ValueError(f"the oracle's reference file {path} holds no prompt")
    return refs


class OracleProposer:
    name = "oracle"
    guesses_bonus = False  # ids only, from no distribution

    def __init__(self, references: dict[tuple[int, ...], list[int]], alpha: float, vocab_size: int,
                 seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"the oracle's acceptance must be in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError(f"the oracle needs a vocabulary of at least 2 tokens, got {vocab_size}")
        self.references = references
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.seed = seed
        self._sessions: dict[str, _Session] = {}

    def start(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        key = hashlib.blake2b(repr(prompt_ids).encode(), digest_size=8).digest()
        self._sessions[session_id] = _Session(len(prompt_ids), list(prompt_ids),
                                              self.references.get(tuple(prompt_ids)), key)

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        return [self._one(job) for job in jobs]

    def _one(self, job: DraftJob) -> Proposal:
        s = self._sessions.get(job.session_id)
        if s is None or s.reference is None or (job.params.temperature > 0 and self.alpha < 1):
            return EMPTY_PROPOSAL
        context = s.committed if job.after.base < 0 else [*s.committed[: job.after.base], *job.after.assume]
        done = len(context) - s.prompt_len
        if context[s.prompt_len:] != s.reference[:done]:  # left the reference: nothing to offer
            return EMPTY_PROPOSAL
        tokens = [self._token(s, done + i) for i in range(min(job.k, MAX_DRAFT_TOKENS, len(s.reference) - done))]
        return Proposal(token_ids=tokens)

    def _token(self, s: _Session, position: int) -> int:
        """The reference's token at ``position`` with probability α, else another one."""
        assert s.reference is not None
        right = s.reference[position]
        rng = random.Random(b"%d:" % self.seed + s.key + b":%d" % position)
        if rng.random() < self.alpha:
            return right
        return (right + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def commit(self, session_id: str, committed_new_tokens: list[int], accepted: int) -> None:
        try:
            self._sessions[session_id].committed.extend(committed_new_tokens)
        except KeyError:
            raise ProposerError(f"no draft session {session_id!r}; start() it first") from None

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
