"""The draft language model as a proposer, with one isolated KV slot per session (StarSD §3).

The model runs through ``shared.runner.ModelRunner``: each session owns a slot of the runner's
KV arena, reserved when the session starts, so a draft step writes only its new token's keys
and values and a rollback only moves the slot's length.

Cache invariant per session: the slot holds the keys/values of ``cached``, a list of token ids
that is always a prefix of what was fed. Before drafting, the cache is cut back to the longest
prefix it shares with the committed sequence, keeping at least the last committed token out of
it (its logits are what the first draft token is chosen from). That one rule rolls back
rejected drafts, keeps accepted ones, and never recomputes a token the cache already holds.
A session's draft cache takes the rows of the longest prefix of its text that another session's
cache holds (``_adopt_prefix``: on a first draft, a chat template's system prompt), as the
verifier's prefix cache does.
The last closed session's cache is kept for this until its room is needed, so one request after
another shares too. Keys are stored after rotary at absolute positions, so equal tokens at equal
positions have equal rows; llama.cpp tags the same cells rather than copying them. On an edge CPU
the prompt's prefill is a large share of a drafter's work (about 7 ms a token for the Q4_1 copy
on one AVX2 core, a third of its busy time at 4 chat requests).
A lookahead for another outcome than "all accepted" drafts in a spare cache of the session, and
a commit that makes its outcome true makes that spare the main cache (``draft_cache.py``).

A greedy draft records each token's runner-up, the draft model's second choice: when the
verifier rejects a greedy draft, its own token is often that one, so a lookahead can start
from it before the verdict arrives.

**Looked-up rows.** A greedy draft step also feeds, after its own token, up to ``lookup_rows``
tokens that prompt lookup guesses come next (the n-gram match of ``proposers/ngram.py`` over the
session's text), and keeps each guess the draft model itself then drafts: its row's logits give the
next token at once. A draft model's forward reads every weight whatever its rows, so on an edge
CPU a step that yields several tokens costs little more than one (ML-SpecQD's second level, with
prompt lookup as the lower level). Where a row's logits depend on its own context alone (the fused
blocks, the 4-bit kernel, any batch-invariant runner) the tokens are exactly the ones drafting one
at a time gives; only the rows of rejected guesses are rolled back. An offline count on the
target's answers to the held-out chat prompts: three guesses from matches of 2 to 4 tokens, 1.49
tokens a forward for 0.78 extra rows; in service on those prompts 9 to 13 % of the committed tokens
came without a forward of their own, 35 % on code-like ones. A raced row (a sampled request's keyed
race) keeps a guess that wins its position's race, which depends on that row's logits and position
alone. Rows that must be their own step get no guesses: those sampled from the session's stream,
penalised ones, and those a controller watches token by token. A row whose features are only sent on
(``--send-confidence``) keeps its guesses, each with its row's features. A step of one session whose
text has no match feeds instead the next-token table's guess (``shared.next_tokens``, ``--next-tokens``):
its second row costs little on an edge CPU, and the table's guesses are right about four times in ten.

Sessions are drafted in batches (StarSD §3): each draft position of every session in the batch
is one packed forward of the draft model, so a batch of B sessions drafting k tokens costs k
forwards, not B·k. A session leaves the batch when it has its k tokens, drafts an end token,
or its controller stops it.

Draft modes:

* ``sampled`` (the default): a greedy request gets argmax ids (the verifier treats q as one-hot,
  which is exact); a raced request (``DraftJob.race_key``: the verifier draws its tokens by keyed
  races, ``shared.race``) gets, at each position, the winner of the same race over its own
  distribution (temperature, top-k, top-p, as the target samples), ids only, and the race's
  runner-up as its second choice; any other sampled request is drafted from its own
  distribution, cut to a nucleus, with the session's drafting generator, and that nucleus goes
  on the wire as the draft's q (``shared.draft_q``).
* ``greedy`` (the baseline): argmax ids for every request. Lossless at any temperature, but at
  temperature 1 each draft is accepted only with probability p(x).

A request with penalties (``logit_bias``, repetition, frequency, presence) is drafted from the
draft model's logits penalised exactly as the verifier penalises p (``shared.penalties``), with
the draft tokens before each position counted as generated. Correctness does not depend on it
(the verifier applies them to p); acceptance does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.drafter.control.base import StepDecision, StepFeatures
from services.drafter.proposers.base import EMPTY_PROPOSAL, DraftJob, DraftRun, Proposal, ProposerError
from services.drafter.proposers.draft_cache import KVCache, SessionCaches
from services.drafter.proposers.draft_rows import (
    Drafting,
    Mode,
    Pick,
    SessionCache,
    first_rows,
    penalise,
    step_features,
)
from services.drafter.proposers.ngram import lookup
from shared.draft_q import Nucleus, draft_token, guess_token
from shared.log import get_logger
from shared.next_tokens import NextTokens
from shared.penalties import has_penalties
from shared.prefix import common_prefix_len
from shared.protocol import MAX_DRAFT_TOKENS
from shared.race import top_two
from shared.runner import KVSlot, Segment
from shared.runner.step import SegmentRunner
from shared.runner.topk import topk
from shared.sampling import is_greedy, probs_from_logits

DRAFT_MODES = ("sampled", "greedy")

log = get_logger("drafter.proposer")
#: a first draft shares another session's prompt rows only when at least this many are shared (a
#: shorter share saves less than the scan for it costs)
MIN_SHARED_PREFIX = 4
#: looked-up rows: the longest and the shortest n-gram whose latest earlier occurrence is looked up
LOOKUP_MAX_N = 4
LOOKUP_MIN_N = 2


class DraftModelProposer:
    """Drafts with a causal LM. Not thread-safe: the serving loop calls it from one worker."""

    name = "draft_model"

    def __init__(self, runner: SegmentRunner, eos_ids: set[int] | frozenset[int], mode: str = "sampled",
                 nucleus: Nucleus | None = None, share_prefixes: bool = True, lookup_rows: int = 0) -> None:
        if mode not in DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {', '.join(DRAFT_MODES)}, got {mode!r}")
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.mode = mode
        self.nucleus = nucleus or Nucleus()
        self.guesses_bonus = mode == "sampled"
        self._sessions: dict[str, SessionCache] = {}
        self.share_prefixes = share_prefixes  # --share-prefixes; false: the baseline, every prompt prefilled
        self.shared_prefix_tokens = 0  # rows taken from other sessions' caches, not computed
        self._donor: KVCache | None = None  # the last closed session's main cache, kept for its rows
        self.lookup_rows = lookup_rows  # --lookup-rows: guesses fed after a greedy step's token (0: none)
        self.looked_up = 0  # guessed rows fed ...
        self.looked_up_kept = 0  # ... and those the draft model drafted too (tokens without a forward of their own)
        #: a second source of guesses, for a step of one session where lookup finds no match (--next-tokens)
        self.next_tokens: NextTokens | None = None
        self.table_guesses = 0  # of looked_up, the table's ...
        self.table_kept = 0  # ... and of looked_up_kept

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, session_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        need = max(1, min(self.max_model_len, len(prompt_ids) + max_new_tokens + MAX_DRAFT_TOKENS))
        slot = self._allocate(need)
        main = None if slot is None else KVCache(slot)
        state = SessionCache(committed=list(prompt_ids),
                             caches=SessionCaches(self.runner.kv, main, make_room=self._drop_donor))
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
        state.caches.promote(state.committed)
        self._check_ids(session_id, state, committed_new_tokens)

    def close(self, session_id: str) -> None:
        state = self._sessions.pop(session_id, None)
        if state is None:
            return
        state.closed = True
        if not state.drafting:  # else its draft leaves the run at the next step, and gives the caches back then
            self._release(state)

    def _release(self, state: SessionCache) -> None:
        main, state.caches.main = state.caches.main, None
        state.caches.close()  # the spares
        if main is not None and main.cached and self.share_prefixes:
            self._drop_donor()
            self._donor = main
        elif main is not None:
            self.runner.kv.free(main.slot)

    def cached_tokens(self, session_id: str) -> int:
        """How many tokens the session's main cache holds (for tests and stats)."""
        main = self._get(session_id).caches.main
        return 0 if main is None else len(main.cached)

    def _allocate(self, tokens: int) -> KVSlot | None:
        """A session's main slot; spares of other sessions give way to it."""
        kv = self.runner.kv
        if tokens > kv.tokens:
            return None
        if not kv.fits(tokens):
            self._drop_donor()
        if not kv.fits(tokens):
            for state in self._sessions.values():
                state.caches.release()
        return kv.allocate(tokens)

    def _drop_donor(self) -> None:
        """Give the kept cache of the last closed session back (its room is needed)."""
        if self._donor is not None:
            self.runner.kv.free(self._donor.slot)
            self._donor = None

    # --- drafting ------------------------------------------------------------------------

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        """Draft every job's session together: one forward per draft position for all of them."""
        run = self.begin(jobs)
        got: dict[int, Proposal] = {}
        try:
            while True:
                got.update((id(job), proposal) for job, proposal in run.take_finished())
                if run.done:
                    break
                self.step(run)
        finally:
            if not run.done:  # the forward raised
                self.abandon(run)
        return [got.get(id(job), EMPTY_PROPOSAL) for job in jobs]

    def begin(self, jobs: Sequence[DraftJob]) -> DraftRun:
        run = DraftRun()
        self.join(run, jobs)
        return run

    def join(self, run: DraftRun, jobs: Sequence[DraftJob]) -> None:
        for job in jobs:
            d = self._begin(job)
            if d is None:
                run.finished.append((job, EMPTY_PROPOSAL))
            else:
                d.state.drafting += 1
                run.live.append(d)

    def step(self, run: DraftRun) -> int:
        """One forward for the run's live sessions (sessions closed since the last one leave first)."""
        for d in [d for d in run.live if d.state.closed]:
            self._leave(run, d)
        live: list[Drafting] = list(run.live)
        if not live:
            return 0
        with torch.inference_mode():
            for d in live:
                d.guesses = self._look_up(d, table=len(live) == 1)
            logits = self.runner.forward([Segment(d.cache.slot, [*d.feed, *d.guesses], len(d.feed) - 1)
                                          for d in live])
            assert logits is not None
            top = topk(logits, min(2, logits.shape[-1]))  # every greedy row in one op
            top2 = top.indices.tolist()
            first = first_rows(live)  # each session's row for its own token; its guesses' follow
            picks = [self._pick(d, logits[row], top2[row]) for row, d in zip(first, live, strict=True)]
            heads = logits if len(first) == len(logits) else logits[first]
            values = top.values if len(first) == len(logits) else top.values[first]
            for row, d, pick, step in zip(first, live, picks, step_features(live, picks, heads, values),
                                          strict=True):
                d.cache.cached.extend(d.feed)
                self._take(d, pick, step)
                if d.guesses:
                    self._keep_guesses(d, logits, top2, top.values, row)
        for d in [d for d in live if d.done]:
            self._leave(run, d)
        return len(live)

    def abandon(self, run: DraftRun) -> None:
        for d in list(run.live):
            self._leave(run, d, keep=False)
        run.finished.clear()

    def _leave(self, run: DraftRun, d: Drafting, keep: bool = True) -> None:
        """``d`` leaves the run (with its proposal, if ``keep``); a session closed meanwhile gives its
        caches back now."""
        run.live.remove(d)
        if keep:
            sampled = d.mode.sampled
            run.finished.append((d.job, Proposal(token_ids=d.tokens, q=d.qs if sampled else None, steps=d.steps,
                                                 final=d.final, runner_up=[] if sampled else d.runner_up)))
        d.state.drafting -= 1
        if d.state.closed and not d.state.drafting:
            self._release(d.state)

    def _begin(self, job: DraftJob) -> Drafting | None:
        """Roll the session's cache back to its committed sequence; None when it drafts nothing."""
        state = self._sessions.get(job.session_id)
        if state is None:  # closed while its job waited
            return None
        context = state.committed if job.after.base < 0 else [*state.committed[: job.after.base], *job.after.assume]
        limit = self._clamp(state, len(context), job.k + job.spare)
        k = min(job.k, limit)
        cache = state.caches.for_job(job.after.branch, context) if k else None
        if cache is None:
            return None
        if job.after.branch <= 0 and self.share_prefixes:
            self._adopt_prefix(job.session_id, cache, context)
        watch = job.controller if job.controller is not None and job.controller.wants_features else None
        enders = frozenset(job.params.stop_token_ids) | (frozenset() if job.params.ignore_eos else self.eos_ids)
        sampled = self.mode == "sampled" and not is_greedy(job.params)
        raced = sampled and job.session.race_key is not None
        spread = (watch is not None and watch.wants_spread) or job.spread
        mode = Mode(sampled and not raced, raced, enders, watch, watch is not None or job.features, spread,
                    has_penalties(job.params))
        return Drafting(job, state, cache, k, mode, feed=context[len(cache.cached):], context=context,
                        limit=limit)

    def _look_up(self, d: Drafting, table: bool = False) -> list[int]:
        """The tokens prompt lookup guesses follow this step's (none for a row that samples from its
        stream, is penalised or is watched token by token, or with no room left). A raced row gets its
        guesses: a race's winner depends only on the row's logits and its position, so a guess is kept
        when it wins the race there, as drafting it alone would pick it. A row whose features are only
        sent on (``--send-confidence``, a lookahead screened later) gets its guesses too: each kept
        guess's row gives its features as its own step would."""
        d.by_table = False
        room = min(self.lookup_rows, d.limit - len(d.tokens) - 1)
        if room <= 0 or d.mode.sampled or d.mode.penalised or d.mode.watch is not None:
            return []
        guesses = lookup([*d.context, *d.tokens], room, LOOKUP_MAX_N, LOOKUP_MIN_N)
        if not guesses and table and self.next_tokens is not None:
            # the step's one free row (next_tokens.py): the table's guess, where lookup found no match
            guess = self.next_tokens.guess([*d.context[-2:], *d.tokens][-2:])
            guesses = [] if guess is None else [guess]
            self.table_guesses += len(guesses)
            d.by_table = bool(guesses)
        self.looked_up += len(guesses)
        return guesses

    def _keep_guesses(self, d: Drafting, logits: torch.Tensor, top2: list[list[int]], values: torch.Tensor,
                      row: int) -> None:
        """After ``_take`` of the step's own token: while the token just drafted is the next guess, that
        guess's row (already fed) gives the token after it, with its features when the row wants them
        (``values``: every row's two best logits). The slot then drops the rows of the rest."""
        for j, guess in enumerate(d.guesses):
            if d.final or len(d.tokens) >= d.limit or d.tokens[-1] != guess:
                break
            d.cache.cached.append(guess)  # its keys and values are the ones feeding it would write
            self.looked_up_kept += 1
            self.table_kept += d.by_table
            at = row + 1 + j
            pick = self._pick(d, logits[at], top2[at])
            # counted in its own step's batch, of which it came free
            step = step_features([d], [pick], logits[at : at + 1], values[at : at + 1],
                                 sessions=d.steps[-1].rows)[0] if d.mode.features else None
            self._take(d, pick, step)
        d.cache.slot.truncate(len(d.cache.cached))
        d.done = d.final or len(d.tokens) >= d.k

    def _pick(self, d: Drafting, logits: torch.Tensor, top2: list[int]) -> Pick:
        """Choose the next token of one session from its logits row (``top2``: its two best ids)."""
        if d.mode.penalised:
            logits = penalise(d, logits)
            top2 = topk(logits.unsqueeze(0), len(top2)).indices[0].tolist()
        if d.mode.raced:
            assert d.job.session.race_key is not None
            key = d.job.session.race_key
            token, up = top_two(probs_from_logits(logits, d.job.params), key, len(d.context) + len(d.tokens))
            return Pick(token, up, None, logits)
        if d.mode.sampled and d.job.after.guess is not None and not d.tokens:
            return Pick(guess_token(logits, d.job.params, d.job.after.guess), -1, None, logits)  # never sent: no q
        if d.mode.sampled:
            token, q = draft_token(logits, d.job.params, d.job.session.rng, self.nucleus)
            return Pick(token, -1, q, logits)
        return Pick(top2[0], top2[-1], None, logits)

    def _take(self, d: Drafting, pick: Pick, step: StepFeatures | None) -> None:
        """Keep the picked token unless the controller discards it; decide whether to go on."""
        decision = StepDecision.CONTINUE
        if step is not None:
            decision = d.mode.watch.on_step(step) if d.mode.watch is not None else StepDecision.CONTINUE
            if decision is StepDecision.DISCARD:
                d.done = d.final = True
                return
            d.steps.append(step)
        d.tokens.append(pick.token)
        d.runner_up.append(pick.runner_up)
        if pick.q is not None:
            d.qs.append(pick.q)
        d.final = decision is StepDecision.STOP or pick.token in d.mode.enders  # nothing follows an end token
        d.done = d.final or len(d.tokens) >= d.k
        d.feed = [pick.token]

    def _adopt_prefix(self, session_id: str, cache: KVCache, context: list[int]) -> None:
        """Give ``cache`` the rows of the longest prefix of ``context`` (its last token aside: the
        draft feeds it for its logits) that another session's main cache holds, or the last closed
        session's, when that is at least MIN_SHARED_PREFIX more than it holds itself."""
        want = len(context) - 1
        if want - len(cache.cached) < MIN_SHARED_PREFIX:
            return
        best, donor = len(cache.cached), None
        donors = [o.caches.main for sid, o in self._sessions.items() if sid != session_id]
        for main in [*donors, self._donor]:
            if main is None or len(main.cached) <= best:
                continue
            if (n := min(common_prefix_len(main.cached, context), want)) > best:
                best, donor = n, main
        if donor is None or best - len(cache.cached) < MIN_SHARED_PREFIX:
            return
        self.runner.kv.share(donor.slot, cache.slot, best)
        self.shared_prefix_tokens += best - len(cache.cached)
        cache.cached = context[:best]

    def _clamp(self, state: SessionCache, context_len: int, k: int) -> int:
        """Never draft past the slot, the draft model's context or the wire's per-frame ceiling."""
        main = state.caches.main
        if state.disabled or main is None:
            return 0
        room = min(self.max_model_len, main.slot.capacity) - context_len
        return max(0, min(k, room, MAX_DRAFT_TOKENS))

    # --- helpers -------------------------------------------------------------------------

    def _get(self, session_id: str) -> SessionCache:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise ProposerError(f"no draft session {session_id!r}; start() it first") from None

    def _check_ids(self, session_id: str, state: SessionCache, ids: list[int]) -> None:
        """A token the draft model has no embedding for makes drafting impossible, not fatal."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad and not state.disabled:
            state.disabled = f"token id {bad[0]} is outside the draft model's vocabulary of {self.vocab_size}"
            log.warning("session drafts nothing from here on", request_id=session_id, reason=state.disabled)
