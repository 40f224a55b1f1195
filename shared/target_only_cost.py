"""What one target-only forward costs: every session fed one token, as decoding without drafts runs.

The verifier measures such forwards (at start-up, and whenever one runs while serving) and keeps,
for each session count ``B`` it has seen, a line in the sessions' mean cached rows ``L``:
``seconds = at_zero + per_row · L``. A reader (the coordinator's speedup estimate) gets those lines
as a table and interpolates in ``B``. A line per session count, not one plane through all of them:
on a memory-bound CPU a step of 4 sessions costs little more than one of 1, and of 8 much more,
which no single line in ``B`` follows (measured on SmolLM2-135M, bfloat16, one core: 38, 32 and
40 ms at 1, 4 and 8 sessions of 32 cached rows, 78 ms at 8 of 256).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

#: one line per session count: (sessions, seconds at no context, seconds per cached row of each)
Table = Sequence[tuple[int, float, float]]


def forward_seconds(table: Table, sessions: float, context: float) -> float | None:
    """Seconds of a forward feeding ``sessions`` sessions one token each after ``context`` cached
    rows: piecewise linear between the table's session counts, no cheaper than its smallest one
    below it, and along its last two counts' slope (never falling) above its largest. None for an
    empty table."""
    points = sorted((b, at_zero + per_row * context) for b, at_zero, per_row in table)
    if not points:
        return None
    if sessions <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in pairwise(points):
        if sessions <= b1:
            return t0 + (t1 - t0) * (sessions - b0) / (b1 - b0)
    if len(points) == 1:
        return points[0][1]
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + max(t1 - t0, 0.0) / (b1 - b0) * (sessions - b1)
