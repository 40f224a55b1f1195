"""Whether a drafter drafts a session's next round while this one is verified (``lookahead.py``):
StarSD's gate (starsd.txt §3, §4.2); its baseline, ``--pipeline-sessions 0``, never drafts ahead
(``python -m bench serving`` measures both: "no pipelining").

Drafting ahead pays only while the draft model would otherwise idle: below StarSD's N_full
(``capacity.py``), and at most ``--pipeline-sessions`` sessions. With more, lookaheads only took
edge CPU from real rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.drafter.control.capacity import Capacity


@dataclass(frozen=True)
class PipelineGate:
    max_sessions: int  # --pipeline-sessions: draft ahead while serving at most this many (0: never)

    def allows(self, active: int, capacity: Capacity) -> bool:
        """Whether ``active`` sessions leave the draft model time to draft ahead."""
        n_full = capacity.n_full
        return active <= self.max_sessions and (n_full is None or active < n_full)
