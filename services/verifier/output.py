"""From engine results to frames: Verdicts for drafters, TokenEvents for frontends.

Runs on the event loop while the engine core already computes the next step. For each round
it pushes the new tokens through the session's incremental detokenizer, where stop strings
are found (a stop string ends the session here, and the core is told to drop it), then queues
one frame per peer for the whole step: a step's Verdicts to one drafter, or its TokenEvents to
one coordinator, travel as a single Batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Protocol

from services.verifier.core_api import (
    Admitted,
    Attached,
    Detached,
    Filled,
    Finish,
    OutOfTurn,
    RequestRefused,
    Result,
    Rounded,
    VerifierCore,
)
from services.verifier.metrics import VerifierMetrics
from services.verifier.round.stops import cut_at_stop_string
from services.verifier.sessions import Route, Routes
from shared.log import get_logger
from shared.protocol import (
    Adopted,
    Batchable,
    ErrorFrame,
    FinishReason,
    OpenSession,
    SessionOpened,
    TokenEvent,
    TokenLogprob,
    Verdict,
)

log = get_logger("verifier.output")
#: events per frame of an Adopt's replay: a Batch may hold 4096 items, and 256 events with logprobs
#: (20 alternatives per token) stay far below the 4 MiB frame limit
REPLAY_BATCH = 256


class Peers(Protocol):
    """The connection registry (the server's Hub)."""

    def send(self, conn_id: str, msgs: list[Batchable]) -> None: ...

    def send_frontend(self, origin: str, msgs: list[Batchable]) -> None: ...

    def trusted(self, conn_id: str) -> bool: ...


class Output:
    def __init__(self, peers: Peers, routes: Routes, metrics: VerifierMetrics) -> None:
        self.peers = peers
        self.routes = routes
        self.metrics = metrics
        self.core: VerifierCore | None = None  # set once built (it needs our on_results)
        self._to_conn: defaultdict[str, list[Batchable]] = defaultdict(list)
        self._to_origin: defaultdict[str, list[Batchable]] = defaultdict(list)

    # --- results of one engine step ------------------------------------------------------

    def on_results(self, results: list[Result]) -> None:
        started = time.perf_counter()
        for r in results:
            if isinstance(r, Rounded):
                self._round(r)
            elif isinstance(r, Filled):
                self._filled(r)
            elif isinstance(r, Admitted):
                self._admitted(r)
            elif isinstance(r, RequestRefused):
                self._refused(r)
            elif isinstance(r, OutOfTurn):
                route = self.routes.get(r.request_id)
                if route is not None and route.drafter is not None:
                    self._conn(route.drafter, ErrorFrame(code="out_of_turn", message=r.message,
                                                         request_id=r.request_id))
            elif isinstance(r, Attached):
                self._attached(r)
            elif isinstance(r, Detached):
                route = self.routes.get(r.request_id)
                if route is not None:
                    route.drafter = route.owner = None
        self.flush()
        self.metrics.publish.observe(time.perf_counter() - started)

    def _admitted(self, r: Admitted) -> None:
        route = self.routes.get(r.request_id)
        # only to the drafter that opened it: one that resumed it since hears Attached instead
        if route is not None and route.owner is not None and route.owner == route.opener:
            self._conn(route.owner, SessionOpened(request_id=r.request_id, draft_budget=r.draft_budget,
                                                    bonus_key=self._key_for(route.owner, r.bonus_key),
                                                    race_key=r.race_key))

    def _attached(self, r: Attached) -> None:
        route = self.routes.get(r.request_id)
        if route is not None and route.drafter is not None:
            self._conn(route.drafter, SessionOpened(request_id=r.request_id, draft_budget=r.draft_budget,
                                                    committed_ids=r.generated, round=r.round,
                                                    bonus_key=self._key_for(route.drafter, r.bonus_key),
                                                    race_key=r.race_key))

    def _key_for(self, conn_id: str, key: int | None) -> int | None:
        """The bonus key (shared.coupling) only for a trusted drafter: the intake ignores an untrusted
        one's guess_bonus, so with the key it would only draft lookaheads that can never be used."""
        return key if self.peers.trusted(conn_id) else None

    def _refused(self, r: RequestRefused) -> None:
        route = self.routes.get(r.request_id)
        if route is None:
            return
        if r.code != "busy":  # the verifier owned it: its client hears why
            self._event(route, [], finished=True, reason="error", error=r.message, error_code=r.code)
        self._conn(route.opener, ErrorFrame(code=r.code, message=r.message, request_id=r.request_id))
        self.routes.close(r.request_id)

    def _round(self, r: Rounded) -> None:
        route = self.routes.get(r.request_id)
        if route is None:  # ended here already (cancel, stop string): the core's result is stale
            return
        kept, stopped = self._text(route, r.tokens)
        finished = r.finished or stopped
        reason: FinishReason | None = "stop" if stopped else r.finish_reason
        route.drafted += r.drafted
        route.accepted += r.accepted
        self._event(route, kept, finished, reason, r.error, r.logprobs[: len(kept)] if r.logprobs is not None else None)
        self._verdict(route, r.round, r.accepted, [*r.prior, *kept], finished, reason, r.draft_budget)

    def _filled(self, r: Filled) -> None:
        """Tokens of a round still open go to the client; the drafter hears of them with the round's
        Verdict, unless a stop string ends the request here."""
        route = self.routes.get(r.request_id)
        if route is None:
            return
        kept, stopped = self._text(route, r.tokens)
        self._event(route, kept, stopped, "stop" if stopped else None,
                    logprobs=r.logprobs[: len(kept)] if r.logprobs is not None else None)
        if stopped:  # the round ends here: the drafter's draft for it is moot
            self._verdict(route, r.round, 0, [*r.prior, *kept], True, "stop", 0)

    def _text(self, route: Route, tokens: list[int]) -> tuple[list[int], bool]:
        """Push ``tokens`` through the session's text: those kept (up to a stop string), and
        whether one ended the request (the core is then told to drop it)."""
        kept, stopped = cut_at_stop_string(route.text, tokens)
        route.completion_tokens += len(kept)
        if stopped and self.core is not None:
            self.core.submit(Finish(route.request_id))
        return kept, stopped

    def _verdict(self, route: Route, round_: int, accepted: int, tokens: list[int], finished: bool,
                 reason: FinishReason | None, budget: int) -> None:
        """The round's Verdict to the session's drafter (a finished one to its opener when it has none)."""
        peer = route.drafter if route.drafter is not None else (route.owner if finished else None)
        if peer is not None:
            self._conn(peer, Verdict(request_id=route.request_id, round=round_, accepted=accepted,
                                     token_ids=tokens, finished=finished, finish_reason=reason,
                                     draft_budget=0 if finished else budget))
        if finished:
            self.routes.close(route.request_id)

    # --- out-of-turn endings (event loop initiated) ---------------------------------------

    def end(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        """Finish a session now (a cancel): tell its client and its drafter, forget it."""
        route = self.routes.get(request_id)
        if route is None:
            return
        self._event(route, [], finished=True, reason=reason, error=error)
        peer = route.drafter or route.owner
        if peer is not None:
            self._conn(peer, Verdict(request_id=request_id, round=0, accepted=0, token_ids=[], finished=True,
                                     finish_reason=reason, draft_budget=0))
        self.routes.close(request_id)
        self.flush()

    def failed_open(self, msg: OpenSession, problem: str) -> None:
        """A request refused at the door: its client gets the reason as a final event."""
        self._to_origin[msg.origin].append(TokenEvent(
            request_id=msg.request_id, origin=msg.origin, token_ids=[], text="", finished=True, finish_reason="error",
            prompt_tokens=len(msg.prompt_ids), error=problem))
        self.flush()

    def adopted(self, conn_id: str, reply: Adopted, events: list[TokenEvent]) -> None:
        """Adopt's answer, then the replay of the request's events, in frames of at most
        REPLAY_BATCH events (each well under the frame size and Batch limits)."""
        self.peers.send(conn_id, [reply])
        for start in range(0, len(events), REPLAY_BATCH):
            self.peers.send(conn_id, list(events[start:start + REPLAY_BATCH]))

    def moved(self, origin: str, request_id: str, adopter: str) -> None:
        """Tell a coordinator that still relays a request that another one took it over (not part
        of the request's events: its client is told the stream went on elsewhere)."""
        self.peers.send_frontend(origin, [TokenEvent(
            request_id=request_id, origin=origin, token_ids=[], text="", finished=True, finish_reason="cancelled",
            error=f"the stream was resumed through coordinator {adopter}", error_code="moved")])

    def error(self, conn_id: str, code: str, message: str, request_id: str | None) -> None:
        self._conn(conn_id, ErrorFrame(code=code, message=message, request_id=request_id))
        self.flush()

    # --- frames --------------------------------------------------------------------------

    def _event(self, route: Route, tokens: list[int], finished: bool, reason: FinishReason | None,
               error: str = "", logprobs: list[TokenLogprob] | None = None, error_code: str = "") -> None:
        route.seq += 1
        event = TokenEvent(
            request_id=route.request_id, origin=route.origin, token_ids=tokens, text=route.text.release(finished),
            finished=finished, finish_reason=reason if finished else None, prompt_tokens=route.prompt_tokens,
            completion_tokens=route.completion_tokens, drafted_tokens=route.drafted, accepted_tokens=route.accepted,
            error=error, logprobs=logprobs, error_code=error_code, seq=route.seq)
        if self.routes.keep_s > 0:  # for a coordinator that adopts the request (sessions.py)
            route.history.append(event)
        if route.origin:  # else an orphan: relayed to nobody until adopted
            self._to_origin[route.origin].append(event)

    def _conn(self, conn_id: str, msg: Batchable) -> None:
        self._to_conn[conn_id].append(msg)

    def flush(self) -> None:
        """Send what this step produced: one frame per peer."""
        for conn_id, msgs in self._to_conn.items():
            self.peers.send(conn_id, msgs)
        for origin, msgs in self._to_origin.items():
            self.peers.send_frontend(origin, msgs)
        self._to_conn.clear()
        self._to_origin.clear()
