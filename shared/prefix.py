"""The common prefix of two token sequences, at C speed.

Slice equality of Python lists runs in C, so a binary search over prefix lengths costs
O(n log n) element comparisons in C instead of n Python-level steps: a few microseconds for
thousand-token prompts, which matters when every verifier step looks for shared prompts.
"""

from __future__ import annotations


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (both lists: a list never equals a tuple)."""
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo]
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
