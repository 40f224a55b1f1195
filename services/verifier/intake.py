"""Turning inbound frames into engine commands, with every check a peer's frame must pass.

Runs on the event loop. A bad frame is answered with an ErrorFrame and changes nothing;
nothing a peer sends can raise out of here. Checks that need no engine state (ownership,
vocabulary, sampling parameters, a draft's q) happen here, so the engine core only ever sees
well-formed work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from services.verifier.core_api import (
    AddDraft,
    AddRequest,
    Attach,
    Carried,
    CoreBusy,
    Detach,
    DraftAsks,
    Finish,
    VerifierCore,
)
from services.verifier.detok import IncrementalText
from services.verifier.grammar import GrammarError, Grammars
from services.verifier.output import Output
from services.verifier.round.stops import Stops
from services.verifier.sessions import ORPHAN, Route, Routes
from shared.draft_q import DraftError, check
from shared.log import get_logger
from shared.protocol import (
    MAX_WAITED_S,
    Adopt,
    Adopted,
    AdoptState,
    Cancel,
    CloseSession,
    Draft,
    FinishReason,
    Message,
    OpenSession,
    Release,
    ResumeDone,
)
from shared.sampling import SamplingError, validate

log = get_logger("verifier.intake")

#: coordinators remembered as gone (their requests are refused to drafters), oldest forgotten first
GONE_ORIGINS_KEPT = 4096


class Intake:
    def __init__(self, core: VerifierCore, routes: Routes, output: Output, tokenizer: Any,
                 names: Callable[[str], str] = str, resume_grace_s: float = 0.0,
                 trusted: Callable[[str], bool] = lambda _conn: True) -> None:
        self.core = core
        self.resume_grace_s = resume_grace_s
        self._started = time.monotonic()
        self._resumed: dict[str, str] = {}  # frontend connection -> its node id, once it sent ResumeDone
        self._gone: dict[str, float] = {}  # coordinator node id -> when its last link closed (until it is back)
        #: connection id -> whether its q is believed; an untrusted drafter's drafts are verified
        #: ids-only (q one-hot), which is lossless however the drafter chose its tokens
        self.trusted = trusted
        self.names = names  # connection id -> the peer's node id (its name in metrics)
        self.routes = routes
        self.output = output
        self.tokenizer = tokenizer
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """Built on the first structured-output request (it reads the whole vocabulary)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.core.vocab_size)
        return self._grammars

    def handle(self, conn_id: str, role: str, msg: Message | None, received_at: float = 0.0) -> None:
        if role == "gone":
            self._drafter_gone(conn_id)
        elif isinstance(msg, ResumeDone) and role == "frontend":
            self._resumed[conn_id] = self.names(conn_id)
            log.info("frontend re-opened its in-flight requests", frontend=self._resumed[conn_id],
                     sessions=msg.sessions)
        elif isinstance(msg, OpenSession):
            self._open(conn_id, role, msg)
        elif isinstance(msg, Draft) and role == "drafter":
            self._draft(conn_id, msg, received_at)
        elif isinstance(msg, CloseSession) and role == "drafter":
            self._detach(conn_id, msg.request_id)
        elif isinstance(msg, Cancel) and role == "frontend":
            self._cancel(conn_id, msg.request_id)
        elif isinstance(msg, Release) and role == "frontend":
            self._release(conn_id, msg.request_id)
        elif isinstance(msg, Adopt) and role == "frontend":
            self._adopt(conn_id, msg.request_id)
        elif msg is not None:
            self.output.error(conn_id, "unexpected", f"a {role} may not send {type(msg).__name__}", None)

    # --- opening -----------------------------------------------------------------------

    def _open(self, conn_id: str, role: str, msg: OpenSession) -> None:
        rid = msg.request_id
        route = self.routes.get(rid)
        if route is not None and route.drafter is None and role == "drafter" and msg.speculative:
            return self._resume(conn_id, route)
        if self.routes.known(rid):
            return self.output.error(conn_id, "duplicate", f"request {rid} is already served or finished", rid)
        adopter = self.routes.adopter(rid)
        if adopter is not None:  # a coordinator adopted it before it was opened: its events go there
            msg = msgspec.structs.replace(msg, origin=adopter)
        elif role == "drafter" and self._orphan_of_gone(msg.origin):
            return self._open_orphan(conn_id, msg)
        refused = self._refusal(role, msg.origin)
        if refused is not None:
            return self.output.error(conn_id, *refused, rid)
        problem = self._check_request(msg)
        grammar = None
        if not problem and msg.params.structured is not None:
            try:
                grammar = self.grammars.matcher(msg.params.structured)
            except GrammarError as exc:
                problem = str(exc)
        if problem:  # the verifier owns the request now: tell its client, then the opener
            self.output.failed_open(msg, problem)
            return self.output.error(conn_id, "invalid", problem, rid)
        speculative = role == "drafter" and msg.speculative
        drafter = conn_id if speculative else None
        resume = msg.resume if role == "frontend" else None
        generated = list(resume.generated_ids) if resume is not None else []
        route = self._route(conn_id, role, msg, drafter)
        if resume is not None and self._ends_at_once(route, msg):
            return None
        try:
            self.core.submit(AddRequest(rid, list(msg.prompt_ids), msg.params, speculative,
                                        self.names(conn_id) if speculative else "", msg.slo_tokens_per_s,
                                        grammar, Carried(generated, min(msg.waited_s, MAX_WAITED_S))))
        except CoreBusy as exc:
            self.routes.close(rid)
            return self.output.error(conn_id, "busy", str(exc), rid)
        log.info("session re-opened" if resume is not None else "session opened", request_id=rid,
                 prompt_len=len(msg.prompt_ids), generated=len(generated), drafter=drafter,
                 temperature=msg.params.temperature)
        return None

    def _refusal(self, role: str, origin: str) -> tuple[str, str] | None:
        """Why a new request of ``origin`` cannot be opened now (code, message), or None."""
        if role == "drafter" and origin in self._gone:  # dropped: the delivery is acked, nobody computes it
            return "orphaned", f"coordinator {origin} is gone and its clients with it; request dropped"
        if role == "drafter" and not self._origin_resumed(origin):
            return "busy", (f"coordinator {origin} has not re-opened its in-flight requests on this verifier yet; "
                            "retry shortly")
        if len(self.routes) >= self.routes.max_sessions:
            return "busy", f"the verifier holds {self.routes.max_sessions} sessions; retry later"
        return None

    def _route(self, conn_id: str, role: str, msg: OpenSession, drafter: str | None) -> Route:
        """The new request's Route, added; a re-opened one continues after what was relayed."""
        route = Route(msg.request_id, msg.origin, conn_id, drafter, conn_id if role == "drafter" else None,
                      len(msg.prompt_ids), IncrementalText(self.tokenizer, list(msg.params.stop)))
        resume = msg.resume if role == "frontend" else None
        if resume is not None:
            route.completion_tokens, route.drafted, route.accepted = (
                len(resume.generated_ids), resume.drafted_tokens, resume.accepted_tokens)
            route.seq = resume.next_seq - 1
            route.text.prime(list(resume.generated_ids), resume.released_chars)
        self.routes.add(route)
        return route

    def _ends_at_once(self, route: Route, msg: OpenSession) -> bool:
        """A re-opened request that was already complete (its final event was lost with the old
        verifier): finish it here, releasing the text held back for stop strings."""
        generated = route.completion_tokens
        if route.text.stopped:
            reason: FinishReason | None = "stop"
        elif Stops.of(msg.params, len(msg.prompt_ids), frozenset(), self.core.max_model_len).length_reached(
                len(msg.prompt_ids) + generated):
            reason = "length"
        else:
            reason = None
        if reason is not None:
            self.output.end(route.request_id, reason)
            log.info("re-opened session was already complete", request_id=route.request_id, finish_reason=reason)
        return reason is not None

    def _origin_resumed(self, origin: str) -> bool:
        """Whether a drafter may open a new session for ``origin``'s request: that coordinator has
        re-opened its in-flight requests here (else this could start one over), or the grace after
        this verifier's start is over."""
        return origin in self._resumed.values() or time.monotonic() - self._started >= self.resume_grace_s

    def _resume(self, conn_id: str, route: Route) -> None:
        """A drafter re-opens a session whose drafter left: it drafts again from the committed text
        (the verifier owns it, so no token is lost or repeated)."""
        route.drafter = route.owner = conn_id
        self._submit(conn_id, Attach(route.request_id, self.names(conn_id)))
        log.info("session resumed by a drafter", request_id=route.request_id, drafter=conn_id)

    def _check_request(self, msg: OpenSession) -> str:
        vocab = self.core.vocab_size
        if max(msg.prompt_ids) >= vocab:
            return f"prompt token id {max(msg.prompt_ids)} is outside the vocabulary of {vocab}"
        if msg.params.logit_bias and max(msg.params.logit_bias) >= vocab:
            return f"logit_bias token id {max(msg.params.logit_bias)} is outside the vocabulary of {vocab}"
        if msg.resume is not None and msg.resume.generated_ids and max(msg.resume.generated_ids) >= vocab:
            return f"a resumed token id {max(msg.resume.generated_ids)} is outside the vocabulary of {vocab}"
        try:
            validate(msg.params, len(msg.prompt_ids), self.core.max_model_len)
        except SamplingError as exc:
            return str(exc)
        return ""

    # --- rounds ------------------------------------------------------------------------

    def _draft(self, conn_id: str, msg: Draft, received_at: float) -> None:
        rid = msg.request_id
        route = self.routes.get(rid)
        if route is not None and route.drafter is not None and route.drafter != conn_id:
            log.warning("draft for another drafter's session refused", request_id=rid, conn=conn_id)
            return self.output.error(conn_id, "not_owner", f"session {rid} belongs to another drafter; a drafter may "
                                                           "draft only for the sessions it opened", rid)
        if route is None or route.drafter != conn_id:
            return self.output.error(conn_id, "unknown_session", f"no session {rid} for this drafter", rid)
        vocab = self.core.vocab_size
        if msg.token_ids and max(msg.token_ids) >= vocab:
            return self.output.error(conn_id, "invalid", f"draft token outside the vocabulary of {vocab}", rid)
        if msg.q is not None and len(msg.q) != len(msg.token_ids):
            return self.output.error(conn_id, "invalid",
                                     f"draft has {len(msg.token_ids)} tokens but {len(msg.q)} q rows", rid)
        q = None
        if msg.q is not None and self.trusted(conn_id):
            try:  # parsed here, once; the core's acceptance step reads the parsed rows
                q = [check(sparse, token, vocab) for sparse, token in zip(msg.q, msg.token_ids, strict=True)]
            except DraftError as exc:  # verifying as ids-only is still exactly lossless
                log.warning("draft q refused; verifying ids-only", request_id=rid, reason=str(exc))
        confidence = msg.confidence if msg.confidence and len(msg.confidence) == len(msg.token_ids) else None
        # an untrusted drafter knows the race's variates, and could choose drafts to steer them
        guess = msg.guess_bonus and self.trusted(conn_id)
        after = tuple(msg.after) if msg.after is not None else None
        self._submit(conn_id, AddDraft(rid, msg.round, list(msg.token_ids), q, received_at, confidence,
                                       DraftAsks(msg.pause_rounds, guess), after, msg.drafting_s,
                                       msg.ahead or after is not None))
        return None

    def _detach(self, conn_id: str, request_id: str) -> None:
        route = self.routes.get(request_id)
        if route is not None and conn_id in (route.drafter, route.owner):
            route.drafter = route.owner = None
            self._submit(conn_id, Detach(request_id))
        elif route is not None and (route.drafter or route.owner):
            self.output.error(conn_id, "not_owner", f"session {request_id} belongs to another drafter; a drafter may "
                                                    "close only its own sessions", request_id)

    def _drafter_gone(self, conn_id: str) -> None:
        """The drafter's link closed: its sessions continue target-only, so no request is lost."""
        moved = self.routes.of_conn(conn_id)
        for route in moved:
            route.drafter = route.owner = None
            self._submit(conn_id, Detach(route.request_id))
        if moved:
            log.warning("drafter gone; sessions continue target-only", conn=conn_id, sessions=len(moved))

    # --- coordinators and their clients' streams (Routes.keep_s > 0: orphans) -------------

    def _orphan_of_gone(self, origin: str) -> bool:
        """A drafter opens a request of a coordinator that left less than the grace ago: it is
        served as an orphan (a resume may still come), not dropped."""
        left = self._gone.get(origin)
        return left is not None and self.routes.keep_s > 0 and time.monotonic() - left < self.routes.keep_s

    def _open_orphan(self, conn_id: str, msg: OpenSession) -> None:
        self._open(conn_id, "drafter", msgspec.structs.replace(msg, origin=ORPHAN))
        route = self.routes.get(msg.request_id)
        if route is not None and route.origin == ORPHAN:
            self.routes.orphan(route)
            log.info("request of a departed coordinator opened as an orphan", request_id=msg.request_id,
                     coordinator=msg.origin, grace_s=self.routes.keep_s)

    def _release(self, conn_id: str, request_id: str) -> None:
        """The coordinator's client left; it may resume elsewhere within the grace (else: a cancel)."""
        route = self.routes.get(request_id)
        if route is None or route.origin != self.names(conn_id):
            return None
        if self.routes.keep_s <= 0:
            return self._cancel(conn_id, request_id)
        self.routes.orphan(route)
        log.info("request released by its coordinator; kept for a resume", request_id=request_id,
                 grace_s=self.routes.keep_s)
        return None

    def _adopt(self, conn_id: str, request_id: str) -> None:
        """Relay ``request_id`` to this coordinator from now on: say how it stands, replay its events."""
        node, route = self.names(conn_id), self.routes.get(request_id)
        kept = self.routes.replay(request_id)
        state: AdoptState
        if route is not None:
            if route.origin and route.origin != node:
                self.output.moved(route.origin, request_id, node)
            self.routes.adopt(route, node)
            events, state = list(route.history), "live"
        elif kept is not None:
            events, state = kept, "finished"
        else:
            state = "gone" if self.routes.known(request_id) else "unknown"
            if state == "unknown" and self.routes.keep_s > 0:
                self.routes.await_adopter(request_id, node)
            events = []
        first, last = (events[0].seq, events[-1].seq) if events else (0, 0)
        self.output.adopted(conn_id, Adopted(request_id=request_id, state=state, first_seq=first, last_seq=last),
                            events)
        log.info("stream adopted", request_id=request_id, coordinator=node, state=state, replayed=len(events))

    def expire_orphans(self) -> None:
        """Cancel the orphans nobody adopted within the grace; forget kept events past it."""
        for route in self.routes.expired():
            self.output.end(route.request_id, "cancelled", "no coordinator resumed its stream within the grace")
            self._submit("", Finish(route.request_id))
            log.info("orphaned request cancelled after the grace", request_id=route.request_id,
                     grace_s=self.routes.keep_s)

    def frontend_up(self, node_id: str) -> None:
        """A coordinator linked (again): drafters may open its requests."""
        self._gone.pop(node_id, None)

    def frontend_gone(self, conn_id: str, node_id: str, still_linked: bool) -> None:
        """A coordinator's link closed. Unless another link of the same coordinator is up, its
        clients have lost their streams. With a grace (``--orphan-grace-s``) its open requests run on
        as orphans, and its queued ones are opened as orphans for as long, so that its clients can
        resume through another coordinator (which adopts them); without one, its open requests are
        cancelled and its queued ones dropped when a drafter opens them, rather than computed for
        nobody."""
        self._resumed.pop(conn_id, None)
        if still_linked:
            return
        self._gone[node_id] = time.monotonic()
        while len(self._gone) > GONE_ORIGINS_KEPT:
            del self._gone[next(iter(self._gone))]
        orphans = self.routes.of_origin(node_id)
        for route in orphans:
            if self.routes.keep_s > 0:  # its clients may resume through another coordinator
                self.routes.orphan(route)
                continue
            self.output.end(route.request_id, "cancelled", f"coordinator {node_id} is gone")
            self._submit("", Finish(route.request_id))
        # logged with no open request too: its queued ones may still be opened (as orphans, or dropped)
        log.warning("coordinator gone; its requests " + ("kept for a resume" if self.routes.keep_s > 0
                                                           else "cancelled"),
                    coordinator=node_id, requests=len(orphans), grace_s=self.routes.keep_s)

    def _cancel(self, conn_id: str, request_id: str) -> None:
        route = self.routes.get(request_id)
        if route is not None and route.origin != self.names(conn_id):
            return self.output.error(conn_id, "not_owner", f"request {request_id} belongs to another frontend; a "
                                                           "frontend may cancel only the requests it sent", request_id)
        if route is not None:
            self.output.end(request_id, "cancelled")
            self._submit("", Finish(request_id))

    def _submit(self, conn_id: str, command: Detach | Attach | Finish | AddDraft) -> None:
        """Detach, Attach and Finish always go through; a draft the core cannot queue is refused as busy."""
        try:
            self.core.submit(command)
        except CoreBusy as exc:
            log.error("engine core overloaded; draft refused", request_id=command.request_id, error=str(exc))
            self.output.error(conn_id, "busy", str(exc), command.request_id)
