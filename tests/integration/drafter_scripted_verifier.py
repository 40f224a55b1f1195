"""A scripted stand-in for the verifier's /v1/drafter endpoint, for the drafter's tests.

It accepts the first draft token of every round and adds a token of its own, finishing after
``finish_after`` generated tokens, and checks every ids-only draft (the drafter sends ids only
for argmax drafts: greedy requests, or any request in greedy mode) against the draft model's own
greedy continuation of the committed sequence (recomputed from scratch, no cache), so a wrong
KV-cache rollback in the drafter shows up in ``problems``. A draft's q is refused as the real
verifier refuses it (``shared.draft_q.check``) and must be the draft model's warped distribution
at that position, restricted to the q's support (a sampled draft's rollback is checked too).

With ``oracle`` the script plays a target that *is* the draft model: it accepts every draft and
its own token is the draft model's greedy choice, so every lookahead comes true; with
``conditional`` it also takes conditional drafts (``Draft.after``) as the real verifier does,
holding each until its round's verdict, and ``verdict_delay_s`` leaves the lookaheads time to come.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from websockets.asyncio.server import ServerConnection

from shared.draft_q import DraftError, check, dense
from shared.models import LoadedModel
from shared.protocol import (
    PROTOCOL_VERSION,
    Draft,
    ErrorFrame,
    Hello,
    OpenSession,
    Refused,
    SamplingParams,
    SessionOpened,
    SparseQ,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.sampling import probs_from_logits

BUDGET = 3
Q_RTOL = 2e-3  # q travels as float16


def greedy_continuation(model: LoadedModel, ids: list[int], k: int) -> list[int]:
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(k):
            seq.append(int(model.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@dataclass
class ScriptedVerifier:
    """Plays the verifier's side of /v1/drafter, with knobs for the failure paths."""

    draft: LoadedModel
    finish_after: int = 7
    refuse: str = ""  # a Refused code to answer the Hello with
    busy_first: set[str] = field(default_factory=set)  # answer the first open of these "busy"
    open_errors: dict[str, str] = field(default_factory=dict)  # request_id -> ErrorFrame code at open
    cancel_after_open: set[str] = field(default_factory=set)  # send an unsolicited cancel right after opening
    drop_after_first_draft: bool = False  # close the first connection at its first Draft
    check_greedy: bool = True
    check_q: bool = True  # compare each q with the draft model's distribution
    oracle: bool = False  # accept every draft; the own token is the draft model's greedy choice
    conditional: bool = False  # take conditional drafts (Welcome.conditional_drafts)
    verdict_delay_s: float = 0.0  # wait this long before each verdict
    hellos: list[Hello] = field(default_factory=list)
    held: dict[str, Draft] = field(default_factory=dict)  # a session's conditional drafts for its next round
    taken: list[Draft] = field(default_factory=list)  # conditional drafts that served their round
    rounds: dict[str, int] = field(default_factory=dict)  # the round each session waits a draft for
    last: dict[str, list[int]] = field(default_factory=dict)  # what each session's last round committed
    auth_headers: list[str | None] = field(default_factory=list)
    opens: list[str] = field(default_factory=list)
    waited: dict[str, float] = field(default_factory=dict)  # each OpenSession's waited_s, by request
    drafts: list[Draft] = field(default_factory=list)
    committed: dict[str, list[int]] = field(default_factory=dict)  # prompt + committed tokens
    finished: set[str] = field(default_factory=set)
    concurrent_max: int = 0
    problems: list[str] = field(default_factory=list)
    _open_now: set[str] = field(default_factory=set)
    _params: dict[str, SamplingParams] = field(default_factory=dict)
    _prompt_len: dict[str, int] = field(default_factory=dict)

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.auth_headers.append(ws.request.headers.get("Authorization"))
        hello = decode(await ws.recv())
        assert isinstance(hello, Hello)
        self.hellos.append(hello)
        connection = len(self.hellos)
        if self.refuse:
            await ws.send(encode(Refused(code=self.refuse, message="tokenizer mismatch: use the target's tokenizer")))  # type: ignore[arg-type]
            return
        await ws.send(encode(Welcome(node_id="scripted-verifier", protocol_version=PROTOCOL_VERSION,
                                     target_model="tiny", tokenizer_fingerprint=hello.tokenizer_fingerprint,
                                     max_model_len=512, max_draft_tokens=16,
                                     conditional_drafts=self.conditional)))
        async for raw in ws:
            msg = decode(raw)
            if isinstance(msg, OpenSession):
                await self._on_open(ws, msg)
            elif isinstance(msg, Draft) and msg.after is not None:
                await self._on_conditional(ws, msg)
            elif isinstance(msg, Draft):
                if self.drop_after_first_draft and connection == 1:
                    self.drafts.append(msg)
                    await ws.close()
                    return
                await self._on_draft(ws, msg)

    async def _on_open(self, ws: ServerConnection, msg: OpenSession) -> None:
        rid = msg.request_id
        self.opens.append(rid)
        self.waited[rid] = msg.waited_s
        if rid in self.busy_first:
            self.busy_first.discard(rid)
            await ws.send(encode(ErrorFrame(code="busy", message="full, retry", request_id=rid)))
            return
        if rid in self.open_errors:
            await ws.send(encode(ErrorFrame(code=self.open_errors[rid], message="scripted", request_id=rid)))
            return
        if rid in self.committed:  # re-opened after a link drop: we "finished it target-only"
            await ws.send(encode(ErrorFrame(code="duplicate", message="already served", request_id=rid)))
            return
        self.committed[rid] = list(msg.prompt_ids)
        self._params[rid] = msg.params
        self._prompt_len[rid] = len(msg.prompt_ids)
        self._open_now.add(rid)
        self.concurrent_max = max(self.concurrent_max, len(self._open_now))
        await ws.send(encode(SessionOpened(request_id=rid, draft_budget=BUDGET)))
        if rid in self.cancel_after_open:
            self._open_now.discard(rid)
            self.finished.add(rid)
            await ws.send(encode(Verdict(request_id=rid, round=0, accepted=0, token_ids=[], finished=True,
                                         finish_reason="cancelled", draft_budget=0)))

    async def _on_draft(self, ws: ServerConnection, msg: Draft, conditional: bool = False) -> None:
        rid = msg.request_id
        if not conditional:
            self.drafts.append(msg)
        if rid in self.finished:
            return  # a late draft for a cancelled session: the real verifier ignores it too
        if msg.round != self.rounds.get(rid, 0):
            self.problems.append(f"{rid}: a draft for round {msg.round}, which was not waiting for one")
        while True:
            new = await self._verify(ws, rid, msg)
            held = self.held.pop(rid, None)
            if rid in self.finished or held is None or list(held.after or ()) != new:
                return
            self.taken.append(held)  # it came true: its round runs at once, without a draft from the edge
            msg = held

    async def _on_conditional(self, ws: ServerConnection, msg: Draft) -> None:
        """Held for the round in flight; or, when its verdict already went out committing exactly
        its ``after``, taken at once (it crossed that verdict on the wire)."""
        rid = msg.request_id
        if rid in self.finished:
            return
        if msg.round == self.rounds.get(rid, 0) and tuple(msg.after or ()) == tuple(self.last.get(rid, ())):
            self.taken.append(msg)
            await self._on_draft(ws, msg, conditional=True)
        elif msg.round == self.rounds.get(rid, 0) + 1:
            self.held[rid] = msg

    async def _verify(self, ws: ServerConnection, rid: str, msg: Draft) -> list[int]:
        """Judge one round's draft and send its verdict; the round's committed tokens."""
        seq = self.committed[rid]
        self._check(msg, seq)
        accepted = len(msg.token_ids) if self.oracle else min(1, len(msg.token_ids))
        own = greedy_continuation(self.draft, [*seq, *msg.token_ids], 1)[0] if self.oracle else \
            5 + (len(seq) * 7) % 300  # deterministic and usually unlike the draft's choice
        new = [*msg.token_ids[:accepted], own]
        generated = len(seq) + len(new) - self._prompt_len[rid]
        finished = generated >= self.finish_after
        if finished:
            new = new[: len(new) - (generated - self.finish_after)]
            self._open_now.discard(rid)
            self.finished.add(rid)
        seq.extend(new)
        self.rounds[rid], self.last[rid] = msg.round + 1, new
        await asyncio.sleep(self.verdict_delay_s)
        await ws.send(encode(Verdict(request_id=rid, round=msg.round, accepted=accepted, token_ids=new,
                                     finished=finished, finish_reason="length" if finished else None,
                                     draft_budget=BUDGET)))
        return new

    def _check(self, msg: Draft, seq: list[int]) -> None:
        params = self._params[msg.request_id]
        if msg.q is not None:
            if len(msg.q) != len(msg.token_ids):
                self.problems.append(f"{msg.request_id} round {msg.round}: {len(msg.q)} q for "
                                     f"{len(msg.token_ids)} tokens")
                return
            for i, (token, q) in enumerate(zip(msg.token_ids, msg.q, strict=True)):
                problem = self._check_q(q, token, [*seq, *msg.token_ids[:i]], params)
                if problem:
                    self.problems.append(f"{msg.request_id} round {msg.round} position {i}: {problem}")
        elif self.check_greedy:  # ids only: argmax drafts, whatever the request's temperature
            expected = greedy_continuation(self.draft, seq, len(msg.token_ids))
            if msg.token_ids != expected:
                self.problems.append(f"{msg.request_id} round {msg.round}: {msg.token_ids} != {expected}")

    def _check_q(self, q: SparseQ, token: int, context: list[int], params: SamplingParams) -> str:
        """Why ``q`` is not what ``token`` was drafted from after ``context``; empty when it is."""
        vocab = self.draft.vocab_size
        try:
            check(q, token, vocab)
        except DraftError as exc:
            return f"invalid q: {exc}"
        got = dense(q, vocab)
        if abs(float(got.sum()) - 1.0) > 1e-5 or float(got[token]) <= 0.0:
            return f"q sums to {float(got.sum())} and gives the drafted token {float(got[token])}"
        if not self.check_q:
            return ""
        with torch.inference_mode():
            probs = probs_from_logits(self.draft.model(input_ids=torch.tensor([context])).logits[0, -1], params)
        support = got > 0
        want = torch.where(support, probs, torch.zeros_like(probs))
        want = want / want.sum()
        if not torch.allclose(got, want, rtol=Q_RTOL, atol=1e-6):
            return f"q is off the draft model's distribution by {float((got - want).abs().max()):.2e}"
        return ""
