"""The draft language model as a proposer, with one isolated KV slot per session (StarSD §3).

The model runs through ``shared.runner.ModelRunner``: each session owns a slot of the runner's
KV arena, reserved when the session starts, so a draft step writes only its new token's keys
and values and a rollback only moves the slot's length.

Cache invariant per session: the slot holds the keys/values of ``cached``, a list of token ids
that is always a prefix of what was fed. Before drafting, the cache is cut back to the longest
prefix it shares with the committed sequence, keeping at least the last committed token out of
it (its logits are what the first draft token is chosen from). That one rule rolls back
rejected drafts, keeps accepted ones, and never recomputes a token the cache already holds.

Draft modes:

* ``greedy``: draft the argmax, send ids only. The verifier treats q as one-hot, which is exact.
* ``sampled`` (requests with temperature > 0 only): take the request's own distribution
  (``probs_from_logits``: temperature, top-k, top-p), keep its ``draft_top_k`` largest entries,
  renormalise, sample from that with the session's generator, and send that distribution as a
  SparseQ. Temperature 0 requests are always drafted greedily.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.drafter.control.base import DraftController, StepDecision, StepFeatures
from services.drafter.proposers.base import EMPTY_PROPOSAL, Proposal, ProposerError
from shared.log import get_logger
from shared.protocol import MAX_DRAFT_TOKENS, SamplingParams, SparseQ
from shared.runner import KVSlot, ModelRunner, Segment
from shared.sampling import is_greedy, probs_from_logits

DRAFT_MODES = ("greedy", "sampled")
#: SparseQ carries at most this many entries per position (see shared.protocol).
MAX_Q_ENTRIES = 4096

log = get_logger("drafter.proposer")


@dataclass
class _SessionCache:
    committed: list[int]
    slot: KVSlot | None
    cached: list[int] = field(default_factory=list)  # the tokens the slot holds, in order
    disabled: str = ""  # why this session cannot be drafted for; empty: it can


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """Drafts with a causal LM. Not thread-safe: the serving loop calls it from one worker."""

    name = "draft_model"

    def __init__(self, runner: ModelRunner, eos_ids: set[int], mode: str = "greedy", draft_top_k: int = 16) -> None:
        if mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {', '.join(DRAFT_MODES)}, got {mode!r}")
        if not 1 <= draft_top_k <= MAX_Q_ENTRIES:
            raise ValueError(f"draft_top_k must be in [1, {MAX_Q_ENTRIES}], got {draft_top_k}")
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.mode = mode
        self.draft_top_k = draft_top_k
        self._sessions: dict[str, _SessionCache] = {}

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        need = max(1, min(self.max_model_len, len(prompt_ids) + max_new_tokens + MAX_DRAFT_TOKENS))
        slot = self.runner.kv.allocate(need) if need <= self.runner.kv.tokens else None
        state = _SessionCache(committed=list(prompt_ids), slot=slot)
        self._sessions[session_id] = state
        if slot is None:
            state.disabled = (f"the draft KV cache has no room for {need} more tokens; raise the drafter's "
                              "--kv-cache-gb or lower --max-sessions")
            log.warning("session drafts nothing", request_id=session_id, reason=state.disabled)
        elif not prompt_ids:
            state.disabled = "the prompt is empty: there is no committed token to continue from"
        self._check_ids(session_id, state, prompt_ids)

    def commit(self, session_id: str, committed_new_tokens: list[int], accepted: int) -> None:
        state = self._get(session_id)
        state.committed.extend(committed_new_tokens)
        self._check_ids(session_id, state, committed_new_tokens)

    def close(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is not None and state.slot is not None:
            self.runner.kv.free(state.slot)

    def cached_tokens(self, session_id: str) -> int:
        """How many tokens the session's cache holds (for tests and stats)."""
        return len(self._get(session_id).cached)

    # --- drafting ------------------------------------------------------------------------

    def propose(
        self,
        session_id: str,
        k: int,
        params: SamplingParams,
        rng: torch.Generator,
        controller: DraftController | None = None,
    ) -> Proposal:
        state = self._get(session_id)
        k = self._clamp(state, k)
        if k == 0:
            return EMPTY_PROPOSAL
        sampled = self.mode == "sampled" and not is_greedy(params)
        enders = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        watch = controller if controller is not None and controller.wants_features else None
        self._rollback(state)
        feed = state.committed[len(state.cached) :]
        with torch.inference_mode():
            return self._draft(state, feed, k, params, rng, sampled, enders, watch)

    def _draft(self, state: _SessionCache, feed: list[int], k: int, params: SamplingParams, rng: torch.Generator,
               sampled: bool, enders: frozenset[int], watch: DraftController | None) -> Proposal:
        tokens: list[int] = []
        qs: list[SparseQ] = []
        steps: list[StepFeatures] = []
        for position in range(k):
            logits = self._forward(state, feed)
            token, q = self._choose(logits, params, rng, sampled)
            if watch is not None:
                step = _features(logits, token, position, k)
                decision = watch.on_step(step)
                if decision is StepDecision.DISCARD:
                    break
                steps.append(step)
            else:
                decision = StepDecision.CONTINUE
            tokens.append(token)
            if q is not None:
                qs.append(q)
            if decision is StepDecision.STOP or token in enders:  # nothing follows an end token
                break
            feed = [token]
        return Proposal(token_ids=tokens, q=qs if sampled else None, steps=steps)

    def _clamp(self, state: _SessionCache, k: int) -> int:
        """Never draft past the slot, the draft model's context or the wire's per-frame ceiling."""
        if state.disabled or state.slot is None:
            return 0
        room = min(self.max_model_len, state.slot.capacity) - len(state.committed)
        return max(0, min(k, room, MAX_DRAFT_TOKENS))

    def _rollback(self, state: _SessionCache) -> None:
        assert state.slot is not None
        keep = min(common_prefix_len(state.cached, state.committed), len(state.committed) - 1)
        if keep < len(state.cached):
            state.slot.truncate(keep)
            del state.cached[keep:]

    def _forward(self, state: _SessionCache, feed: list[int]) -> torch.Tensor:
        """Feed the uncached tokens; return the logits for the position after the last one."""
        assert state.slot is not None
        logits = self.runner.forward([Segment(state.slot, feed, len(feed) - 1)])
        state.cached.extend(feed)
        assert logits is not None
        return logits[0]

    def _choose(
        self, logits: torch.Tensor, params: SamplingParams, rng: torch.Generator, sampled: bool
    ) -> tuple[int, SparseQ | None]:
        if not sampled:
            return int(logits.argmax()), None
        probs = probs_from_logits(logits, params)
        values, ids = probs.topk(min(self.draft_top_k, probs.shape[-1]))
        nonzero = values > 0
        values, ids = values[nonzero].double(), ids[nonzero]
        values = values / values.sum()
        token = int(ids[torch.multinomial(values, 1, generator=rng)].item())
        return token, SparseQ(ids=ids.tolist(), probs=[min(1.0, p) for p in values.tolist()])

    # --- helpers -------------------------------------------------------------------------

    def _get(self, session_id: str) -> _SessionCache:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise ProposerError(f"no draft session {session_id!r}; start() it first") from None

    def _check_ids(self, session_id: str, state: _SessionCache, ids: list[int]) -> None:
        """A token the draft model has no embedding for makes drafting impossible, not fatal."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad and not state.disabled:
            state.disabled = f"token id {bad[0]} is outside the draft model's vocabulary of {self.vocab_size}"
            log.warning("session drafts nothing from here on", request_id=session_id, reason=state.disabled)


def _features(logits: torch.Tensor, token: int, position: int, budget: int) -> StepFeatures:
    probs = logits.softmax(-1)
    top = probs.topk(min(2, probs.shape[-1])).values.tolist()
    return StepFeatures(
        position=position,
        budget=budget,
        token_id=token,
        token_prob=float(probs[token]),
        top1_prob=top[0],
        top2_prob=top[1] if len(top) > 1 else 0.0,
        entropy=float(torch.special.entr(probs).sum()),
    )
