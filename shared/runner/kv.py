"""The KV arena: one preallocated tensor holds every session's keys and values.

Layout ``[layers, 2, kv_heads, tokens, head_dim]`` (keys then values, head-major): a session
owns one contiguous range of token rows, reserved once when it is admitted and big enough for
everything it may ever hold (prompt + max_tokens + the widest draft). So a step writes only
its new tokens' rows, attention reads a plain view of each session's rows (no gather, no
padding copy), and rolling back rejected drafts only moves the session's ``length``.

Memory is accounted in bytes against a fixed budget: :meth:`KVArena.allocate` returns None when
a range does not fit, and the caller holds or refuses the session. Ranges are placed first-fit
and freed ranges coalesce with their neighbours.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

import torch


class KVError(RuntimeError):
    """A KV request can never be served (larger than the whole arena, bad sizes)."""


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (slot sizes, key blocks, padded rows)."""
    return -(-n // multiple) * multiple


@dataclass(eq=False)
class KVSlot:
    """One session's range of arena rows. ``length`` rows at the front hold valid keys/values."""

    start: int
    capacity: int
    length: int = 0
    #: rows ``[0, finite)`` hold finite numbers (written, copied or zeroed): the batch-invariant
    #: attention reads a few masked rows past ``length`` (``shared.runner.invariant.clear_key_padding``)
    finite: int = 0

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` valid rows (rejected drafts are simply forgotten)."""
        if not 0 <= length <= self.length:
            raise KVError(f"cannot roll back to {length} rows: the slot holds {self.length}")
        self.length = length

    @property
    def room(self) -> int:
        return self.capacity - self.length


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


class SlotArena(Protocol):
    """What a proposer's caches need of an arena: slots with a token capacity, freed, sharing a
    prefix. :class:`KVArena` (torch) and ``shared.runner.llama.SeqArena`` (llama.cpp) are two."""

    tokens: int

    def allocate(self, tokens: int) -> KVSlot | None: ...

    def free(self, slot: KVSlot) -> None: ...

    def share(self, src: KVSlot, dst: KVSlot, length: int) -> None: ...

    def fits(self, tokens: int) -> bool: ...

    @property
    def largest_free(self) -> int: ...


class KVArena:
    """``align``: every slot's capacity is rounded up to a multiple of it (the batch-invariant
    attention reads each row's keys up to a block boundary, which must stay inside the slot)."""

    def __init__(self, shape: KVShape, budget_bytes: int, device: torch.device | str = "cpu", align: int = 1) -> None:
        tokens = budget_bytes // shape.bytes_per_token
        tokens -= tokens % align
        if tokens < 1:
            raise KVError(f"a KV budget of {budget_bytes} bytes holds no token ({shape.bytes_per_token} bytes each"
                          + (f", {align} at a time)" if align > 1 else ")"))
        self.shape = shape
        self.align = align
        self.tokens = int(tokens)
        # torch.empty: on CPU the pages are only committed as sessions write them.
        self.data = torch.empty((shape.layers, 2, shape.kv_heads, self.tokens, shape.head_dim),
                                dtype=shape.dtype, device=device)
        self._free: list[tuple[int, int]] = [(0, self.tokens)]  # sorted (start, size)
        self._slots: set[KVSlot] = set()

    def release(self) -> None:
        """Give the arena's memory back now, for good (a stopped verifier): its engine's objects
        reference each other, so without this the buffer (up to 2 GiB by default) lived on until
        the garbage collector's next full pass, and verifiers started in one process one after
        another held one each (enough, ten of them, for a fork to fail with ENOMEM)."""
        self.data = self.data.new_empty((0,))
        self._free, self._slots = [], set()

    # --- allocation ----------------------------------------------------------------------

    def allocate(self, tokens: int) -> KVSlot | None:
        """Reserve ``tokens`` contiguous rows, or None when no free range is large enough now."""
        if tokens < 1:
            raise KVError(f"a slot needs at least one token, asked for {tokens}")
        tokens = round_up(tokens, self.align)
        if tokens > self.tokens:
            raise KVError(f"a session needing {tokens} tokens of KV cache can never fit: the arena holds "
                          f"{self.tokens} tokens ({self.budget_bytes / 2**30:.2f} GiB). Raise --kv-cache-gb "
                          "or ask for fewer tokens.")
        for i, (start, size) in enumerate(self._free):
            if size >= tokens:
                if size == tokens:
                    del self._free[i]
                else:
                    self._free[i] = (start + tokens, size - tokens)
                slot = KVSlot(start, tokens)
                self._slots.add(slot)
                return slot
        return None

    def free(self, slot: KVSlot) -> None:
        """Return a slot's rows (idempotent)."""
        if slot not in self._slots:
            return
        self._slots.remove(slot)
        i = bisect.bisect(self._free, (slot.start, 0))
        start, size = slot.start, slot.capacity
        if i < len(self._free) and self._free[i][0] == start + size:  # merge with the next range
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the previous one
            start, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (start, size))

    def share(self, src: KVSlot, dst: KVSlot, length: int) -> None:
        """Give ``dst`` the first ``length`` rows of ``src`` by copying (a prompt prefix both hold:
        keys are stored after rotary at absolute positions, so equal tokens at equal positions
        have equal rows). ``dst``'s own valid rows must already be that prefix; only the rest is
        copied."""
        if not dst.length <= length <= min(src.length, dst.capacity):
            raise KVError(f"cannot share {length} rows: the source holds {src.length}, the destination "
                          f"{dst.length} of {dst.capacity}")
        a, b = dst.length, length
        self.data[:, :, :, dst.start + a : dst.start + b] = self.data[:, :, :, src.start + a : src.start + b]
        dst.length = length
        dst.finite = max(dst.finite, length)

    # --- accounting ----------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return self.tokens * self.shape.bytes_per_token

    @property
    def reserved_tokens(self) -> int:
        return sum(s.capacity for s in self._slots)

    @property
    def cached_tokens(self) -> int:
        return sum(s.length for s in self._slots)

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def fits(self, tokens: int) -> bool:
        return round_up(tokens, self.align) <= self.largest_free

    @property
    def sessions(self) -> int:
        return len(self._slots)
