"""A model-free proposer: prompt lookup (n-gram matching; smartspec.txt §2, Saxena 2023).

To draft for a session, find the most recent earlier place where the sequence's last n tokens
occurred (n from ``max_n`` down to ``min_n``) and propose the tokens that followed it there.
Code, quotes, edits and structured output repeat themselves, so this often guesses right, at no
model cost: it runs on any edge node, and serves sessions that have no draft model.

Drafts are ids only (the verifier treats q as one-hot), which is lossless at any temperature;
at temperature 1 each draft is accepted with probability p(x). Drafting stops after an end token.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from services.drafter.proposers.base import EMPTY_PROPOSAL, DraftJob, Proposal, ProposerError
from shared.protocol import MAX_DRAFT_TOKENS


def lookup(context: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last n tokens."""
    if k <= 0 or len(context) < 2:
        return []
    raw = array("i", context).tobytes()
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        pattern = raw[-4 * n :]
        end = len(raw) - 4  # the match must end before the last token, so something follows it
        while (at := raw.rfind(pattern, 0, end)) >= 0:
            if at % 4 == 0:  # aligned on a token, not inside one
                start = at // 4 + n
                return list(context[start : start + k])
            end = at + len(pattern) - 1
    return []


class NgramProposer:
    name = "ngram"
    guesses_bonus = False  # it drafts ids, from no distribution to race with

    def __init__(self, eos_ids: set[int], max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.eos_ids = frozenset(eos_ids)
        self.max_n, self.min_n = max_n, min_n
        self._committed: dict[str, list[int]] = {}

    def start(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        self._committed[session_id] = list(prompt_ids)

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        return [self._one(job) for job in jobs]

    def _one(self, job: DraftJob) -> Proposal:
        committed = self._committed.get(job.session_id)
        if committed is None:  # closed while its job waited
            return EMPTY_PROPOSAL
        context = committed if job.after.base < 0 else [*committed[: job.after.base], *job.after.assume]
        tokens = lookup(context, min(job.k, MAX_DRAFT_TOKENS), self.max_n, self.min_n)
        enders = frozenset(job.params.stop_token_ids) | (frozenset() if job.params.ignore_eos else self.eos_ids)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in enders), None)
        return Proposal(token_ids=tokens[:cut], final=cut is not None)

    def commit(self, session_id: str, committed_new_tokens: list[int], accepted: int) -> None:
        try:
            self._committed[session_id].extend(committed_new_tokens)
        except KeyError:
            raise ProposerError(f"no draft session {session_id!r}; start() it first") from None

    def close(self, session_id: str) -> None:
        self._committed.pop(session_id, None)
