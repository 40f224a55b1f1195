"""SmartSpec per drafter: each drafter's sessions get the length that maximises goodput on that
drafter's own acceptance and draft waits (the verifier's default).

SmartSpec (``smartspec.py``, smartspec.txt §4.4) estimates one "global token acceptance rate"
over every session: the granularity the paper ships, where one draft model serves every request.
An edge fleet is heterogeneous: the target's own 4-bit copy agrees with it on ~0.95 of tokens,
a lower-width copy on ~0.75, a distilled draft on ~0.25, prompt lookup on chat on ~0.1; their
drafts also take different times (a copy's step is ~0.3 of the target's, a small draft's 0.05).
One rate for all would ask the good drafter for too little and the poor one for too much.

So this policy runs one SmartSpec estimator per drafter (by its node id): each sees only the
rounds of its drafter's sessions, learns that drafter's α and draft waits, and chooses the length
for its sessions, 0 where the drafter's drafts cost more verifier time than they save. The
verifier's load is shared: every estimator prices its rounds at all live sessions (the tracker's),
whoever drafts for them. New requests are wanted drafted for while any drafter's best length is
above 0.

The verifier checks this policy's choices against the clock (``pays.py``): at a load where the
tokens it served fell below what target-only decoding would serve, speculation is switched off
for a while, whatever the estimators predict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.verifier.allocation.base import RoundStats
from services.verifier.allocation.smartspec import SmartSpecAllocator
from services.verifier.allocation.tracker import GoodputTracker

#: drafters remembered; the one heard from least recently is forgotten first (node ids change
#: with every drafter restart, so a long-lived verifier meets many)
MAX_DRAFTERS = 4096
#: a drafter whose sessions drafted within this long still speaks for new requests: longer than the
#: draft waits' horizon (a poor drafter's sessions draft nothing, so its rounds stop reaching the
#: estimator, and its low α must keep new requests target-only), short enough that a drafter gone
#: for good soon stops speaking
SHARE_HORIZON_S = 60.0


class PerDrafterAllocator:
    name = "smartspec-per-drafter"

    def __init__(self, make: Callable[[], SmartSpecAllocator]) -> None:
        self._make = make
        #: each drafter's estimator, the most recently heard from last (dicts keep insertion order)
        self.drafters: dict[str, SmartSpecAllocator] = {}
        self._seen: dict[str, float] = {}  # when each drafter's rounds last came (the estimators' clock)
        self._first = make()  # sessions without a drafter, and the lengths a drafter not yet seen starts from
        self.clock = self._first.wait.clock
        self.last_k = self._first.last_k
        self.last_goodput = 0.0

    def of(self, drafter: str | None) -> SmartSpecAllocator:
        """The estimator of ``drafter``'s sessions, made at its first round (none for no drafter)."""
        if not drafter:
            return self._first
        found = self.drafters.pop(drafter, None)
        if found is None:
            found = self._make()
            while len(self.drafters) >= MAX_DRAFTERS:
                gone = next(iter(self.drafters))
                del self.drafters[gone]
                self._seen.pop(gone, None)
        self.drafters[drafter] = found  # now the most recent
        return found

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        est = tracker.sessions.get(session_id)
        drafter = est.drafter if est else None
        alloc = self.drafters.get(drafter) if drafter else None
        return (alloc or self._first).initial(session_id, tracker)

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        groups: dict[str, list[RoundStats]] = {}
        for r in rounds:
            groups.setdefault(r.drafter or "", []).append(r)
        out: dict[str, int] = {}
        now = self.clock()
        for drafter, group in groups.items():
            alloc = self.of(drafter)
            out.update(alloc.assign(group, tracker))
            if drafter:
                self._seen[drafter] = now
            self.last_k, self.last_goodput = alloc.last_k, alloc.last_goodput
        return out

    def draft_share(self, tracker: GoodputTracker) -> float:
        """All new requests are wanted drafted for while some drafter heard from in the last
        SHARE_HORIZON_S finds a length above 0 best (SmartSpec's own answer, its draft waits expiring
        as they do), or while none was (nothing says otherwise). A read: safe from the event loop."""
        cutoff = self.clock() - SHARE_HORIZON_S
        recent = [alloc for name, alloc in list(self.drafters.items()) if self._seen.get(name, 0.0) >= cutoff]
        if not recent:
            return self._first.draft_share(tracker)
        return max(alloc.draft_share(tracker) for alloc in recent)

    def beliefs(self) -> dict[str, float]:
        """Each drafter's α and chosen length (``alpha.<drafter>``, ``k.<drafter>``), and per load band
        the parts of its draft waits when its drafter times them (``wait_net_s.<drafter>.band<b>``,
        ``wait_per_token_s...``, ``wait_ahead...``)."""
        out: dict[str, float] = {}
        for name, alloc in sorted(list(self.drafters.items())):
            out[f"alpha.{name}"] = round(alloc.alpha(), 4)
            out[f"k.{name}"] = float(alloc.last_k)
            for b, t in sorted(alloc.wait.timed.items()):  # its draft waits' drafter-timed parts (draft_wait.Timed)
                out |= {f"wait_net_s.{name}.band{b}": round(t.net, 6), f"wait_rest_s.{name}.band{b}": round(t.rest, 6),
                        f"wait_per_token_s.{name}.band{b}": round(t.per_token, 6),
                        f"wait_ahead.{name}.band{b}": round(t.ahead, 4)}
        return out
