"""One session's draft KV caches: the main one, and spares for alternative lookaheads.

A cache is a KV slot and the token ids it holds, in order (``cached``): always a prefix of what
was fed. The *main* cache continues the committed sequence. A *spare* drafts a lookahead for
another outcome of the round in flight (``DraftJob.branch``, ``lookahead.py``): "the verifier
rejects draft j and commits the draft model's runner-up instead". A spare is brought up to its
branch's prefix by copying rows from the main cache (``KVArena.share``), and only the rows it
lacks: keys are stored after rotary at absolute positions, so equal tokens at equal positions
have equal rows.

When a commit makes a spare's outcome true, the spare becomes the main cache (a swap of two
references, no copy): the next round drafts on from its rows. Spares are an optimisation only;
the session never depends on them, and they are given back (``release``) as soon as their memory
could serve a session instead, or when the session has stopped asking for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.prefix import common_prefix_len
from shared.runner.kv import KVSlot, SlotArena

#: commits after the last branch job before a session's spares are given back: the session has
#: stopped pipelining (more sessions became active), so the memory is better left free
SPARE_IDLE_COMMITS = 3


@dataclass(eq=False)
class KVCache:
    slot: KVSlot
    cached: list[int] = field(default_factory=list)  # the tokens the slot holds, in order

    def rollback(self, context: list[int]) -> None:
        """Cut back to what the cache shares with ``context``, keeping the last token out (its
        logits are what the next token is chosen from, so it must be fed)."""
        keep = min(common_prefix_len(self.cached, context), len(context) - 1)
        if keep < len(self.cached) or self.slot.length > keep:  # (rows past ``cached``: a step that failed)
            self.slot.truncate(keep)
            del self.cached[keep:]


@dataclass
class SessionCaches:
    """The main cache (None when the arena had no room for the session) and the spares."""

    arena: SlotArena
    main: KVCache | None
    spares: dict[int, KVCache] = field(default_factory=dict)
    idle_commits: int = 0  # commits since a branch job last ran
    #: frees what the proposer keeps that a spare may take instead (the last closed session's cache)
    make_room: Callable[[], None] | None = None

    def for_job(self, branch: int, context: list[int]) -> KVCache | None:
        """The cache a job drafts in, rolled back to ``context``: the main one, or spare ``branch``
        (allocated on first use, None when the arena cannot spare it) synced from the main."""
        if self.main is None:
            return None
        if branch <= 0:
            self.main.rollback(context)
            return self.main
        self.idle_commits = 0
        spare = self.spares.get(branch) or self._allocate(branch)
        if spare is None:
            return None
        spare.rollback(context)
        shared = min(common_prefix_len(self.main.cached, context), len(context) - 1)
        if shared > len(spare.cached):  # copy only the rows the spare lacks
            self.arena.share(self.main.slot, spare.slot, shared)
            spare.cached = context[:shared]
        return spare

    def _allocate(self, branch: int) -> KVCache | None:
        """A spare as large as the main slot, only while a whole further session still fits."""
        assert self.main is not None
        size = self.main.slot.capacity
        if self.arena.largest_free < 2 * size and self.make_room is not None:
            self.make_room()
        if self.arena.largest_free < 2 * size:
            return None
        slot = self.arena.allocate(size)
        if slot is None:
            return None
        self.spares[branch] = spare = KVCache(slot)
        return spare

    def promote(self, committed: list[int]) -> None:
        """After a commit: the cache that holds the most of the committed sequence becomes the main
        one (a lookahead for the outcome that came true drafted in it)."""
        self.idle_commits += 1
        if self.main is None or not self.spares:
            return
        best, held = 0, common_prefix_len(self.main.cached, committed)
        for branch, spare in self.spares.items():
            if (n := common_prefix_len(spare.cached, committed)) > held:
                best, held = branch, n
        if best:
            self.main, self.spares[best] = self.spares[best], self.main
        if self.idle_commits > SPARE_IDLE_COMMITS:
            self.release()

    def release(self) -> None:
        """Give every spare's slot back to the arena."""
        for spare in self.spares.values():
            self.arena.free(spare.slot)
        self.spares.clear()

    def close(self) -> None:
        """Give every slot back (the session ended)."""
        self.release()
        if self.main is not None:
            self.arena.free(self.main.slot)
            self.main = None
