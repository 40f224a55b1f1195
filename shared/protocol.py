"""Every message that crosses a process boundary in specfleet, in one file.

All frames are MessagePack-encoded msgspec structs, tagged by a short ``type`` string so that
one decoder handles any frame. Decoding validates field types and bounds and refuses
oversized or malformed frames with :class:`ProtocolError` (never another exception).

Links and who speaks on them:

* drafter  -> verifier   (WebSocket ``/v1/drafter``): Hello, OpenSession, Draft, CloseSession
* verifier -> drafter:   Welcome, Refused, SessionOpened, Verdict, ErrorFrame
* frontend -> verifier   (WebSocket ``/v1/frontend``, the coordinator): Hello, OpenSession
  (autonomous, target-only sessions, and re-opened ones carrying ``resume``), ResumeDone, Cancel,
  Release and Adopt (a client's stream moves between coordinators)
* verifier -> frontend:  Welcome, Refused, TokenEvent, FleetStatus, ErrorFrame, Adopted
* drafter  -> coordinator queue link (WebSocket ``/internal/queue``, only without Redis):
  Hello, QueuePull, QueueRoom, QueueAck;  coordinator -> drafter: Welcome, QueueDelivery
* Redis stream entries hold one encoded QueuedRequest each.

A ``Batch`` frame carries several round-level messages for one peer (the Verdicts or
TokenEvents of one engine step): one frame per peer per step instead of one per session. Today
only the verifier sends it; drafters send each Draft in a frame of its own, though the verifier
accepts a Batch of them. Receivers handle its items in order, exactly as
if each had come in a frame of its own.

The version rule: a peer whose ``Hello.protocol_version`` differs from ours is refused at the
handshake with a message naming both versions.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

#: what each version added: docs/protocol.md
PROTOCOL_VERSION = 14
#: the most ``OpenSession.waited_s`` a verifier believes (a skewed clock must not make a request overdue for hours)
MAX_WAITED_S = 600.0
#: Largest frame any service accepts. A 32k-token prompt is ~200 KiB; sparse q for 64 draft
#: positions x 4096 entries is 1.5 MiB. 4 MiB leaves room and still bounds a hostile peer.
MAX_FRAME_BYTES = 4 * 1024 * 1024
#: Hard ceiling on draft tokens in one Draft frame, whatever the verifier's budget.
MAX_DRAFT_TOKENS = 64
#: Most entries one position's sparse q may list (6 bytes each on the wire).
MAX_Q_ENTRIES = 4096

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Role = Literal["drafter", "frontend"]
FinishReason = Literal["stop", "length", "cancelled", "error"]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
#: most rounds a drafter may ask the verifier to run without it (Draft.pause_rounds)
MAX_PAUSE_ROUNDS = 1024
#: most conditional drafts (Draft.after) a verifier holds per session for its next round; a drafter
#: sends no more (its lookahead branches beyond them wait for their verdicts)
MAX_CONDITIONAL_DRAFTS = 8
#: most alternatives a request may ask logprobs for at each position (OpenAI's top_logprobs limit)
MAX_LOGPROBS = 20
#: most tokens one request's logit_bias may list
MAX_LOGIT_BIAS = 1024
SloRate = Annotated[float, msgspec.Meta(gt=0.0, le=10_000.0)]  # tokens per second


class ProtocolError(ValueError):
    """A frame was oversized, not MessagePack, or not a valid specfleet message."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of all frames: frozen, strict, tagged by ``type``."""


# --- shared value types -------------------------------------------------------------------


class Structured(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Structured output: the text must match this grammar (services.verifier.grammar).

    ``json_schema``: ``spec`` is a JSON Schema as JSON text; ``regex``: a regular expression;
    ``choice``: a JSON list of the allowed strings.
    """

    kind: Literal["json_schema", "regex", "choice"]
    spec: Annotated[str, msgspec.Meta(min_length=1, max_length=65536)]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the target samples. Validated semantically by ``shared.sampling.validate``.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable truncation.
    """

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    seed: int | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    stop: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]], msgspec.Meta(max_length=16)] = []
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=64)] = []
    ignore_eos: bool = False
    #: None: no logprobs; N: each generated token's logprob and the N most likely alternatives
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    #: "raw": the target's log-softmax before any sampling processing (as vLLM v1's default);
    #: "processed": the log of the distribution actually sampled from (after temperature/top-k/top-p)
    logprobs_mode: Literal["raw", "processed"] = "raw"
    #: penalties on the target's logits (shared.penalties): OpenAI's, and vLLM's repetition_penalty
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    logit_bias: Annotated[dict[TokenId, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                          msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}
    structured: Structured | None = None


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One generated token's logprob under the verifier's p, and the most likely alternatives
    there (``top_ids`` most likely first, ``top_logprobs`` theirs)."""

    logprob: float
    top_ids: list[TokenId]
    top_logprobs: list[float]


class SparseQ(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The drafter's exact sampling distribution at one draft position: a nucleus of it.

    ``ids`` are little-endian uint32 token ids; ``probs`` little-endian float16 probabilities, one
    per id (6 bytes per entry). The drafter sampled from probs / sum(probs), the sum in float64;
    ids not listed have probability 0. ``ids`` must include the drafted token. Built and read by
    ``shared.draft_q``.
    """

    ids: Annotated[bytes, msgspec.Meta(min_length=4, max_length=4 * MAX_Q_ENTRIES)]
    probs: Annotated[bytes, msgspec.Meta(min_length=2, max_length=2 * MAX_Q_ENTRIES)]


class QueuedRequest(_Msg, tag="queued_request", frozen=True):
    """One generation request as it waits in the queue (in-process or a Redis stream)."""

    request_id: RequestId
    prompt_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    params: SamplingParams
    origin: Name  # the coordinator that must receive the TokenEvents
    model: Name
    created_at: float
    protocol_version: int = PROTOCOL_VERSION
    slo_tokens_per_s: SloRate | None = None  # the request's SLO class (WISP batching); None: the default


# --- handshake ------------------------------------------------------------------------------


class Hello(_Msg, tag="hello", frozen=True):
    role: Role
    node_id: Name
    protocol_version: int
    tokenizer_fingerprint: str = ""  # drafters must send theirs; frontends may leave it empty
    model: str = ""  # the draft model's name, for logs and /metrics
    max_sessions: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    #: (v10) a hash of the id -> token table alone (shared.models.Vocabulary), and a line naming the
    #: vocabulary for people: a drafter with the target's token ids but other special tokens joins
    ids_fingerprint: Annotated[str, msgspec.Meta(max_length=64)] = ""
    vocabulary: Annotated[str, msgspec.Meta(max_length=256)] = ""
    site: Annotated[str, msgspec.Meta(max_length=253)] = ""  # (v12) the machine a drafter drafts on


class Welcome(_Msg, tag="welcome", frozen=True):
    node_id: Name
    protocol_version: int
    target_model: str
    tokenizer_fingerprint: str
    max_model_len: int
    max_draft_tokens: int
    #: random per verifier process (v5): a frontend that reconnects to another instance re-opens
    #: its in-flight requests there; "" (queue link, older peers): never resume
    instance: str = ""
    #: the verifier takes conditional drafts (``Draft.after``, v7); False: a drafter must not send them
    conditional_drafts: bool = False
    #: (v9) seconds a request whose coordinator left (or released it) keeps running, and a finished
    #: request's events are kept, so that another coordinator can adopt it; 0: it is cancelled at once
    orphan_grace_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: (v10) the target's vocabulary, as Hello carries the drafter's
    ids_fingerprint: str = ""
    vocabulary: str = ""


class Refused(_Msg, tag="refused", frozen=True):
    """Sent instead of Welcome; the connection is then closed. ``message`` says what to fix."""

    code: Literal["bad_version", "bad_tokenizer", "unauthorized", "bad_hello", "full"]
    message: str


# --- sessions (drafter <-> verifier) --------------------------------------------------------


class ResumeState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a frontend already relayed of a request whose verifier was lost (v5).

    The new verifier continues after ``generated_ids`` (the tokens committed so far, which follow
    the original prompt), skips the first ``released_chars`` characters of their text (already
    sent to the client; the rest was held back for stop strings), and counts on from the
    cumulative drafted/accepted tokens, so usage still describes the original request.
    """

    generated_ids: list[TokenId]
    released_chars: Annotated[int, msgspec.Meta(ge=0)] = 0
    drafted_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    accepted_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: (v9) the ``TokenEvent.seq`` the new verifier numbers its first event with (the next after
    #: the last one relayed), so a client's stream positions stay valid across the restart
    next_seq: Annotated[int, msgspec.Meta(ge=1)] = 1


class OpenSession(_Msg, tag="open_session", frozen=True):
    """Start verifying ``request_id``. From a frontend, the session is autonomous (target-only);
    with ``resume`` it re-opens a request from what the frontend relayed before its verifier was
    lost (a drafter may then resume speculating on it, as for any session without a drafter)."""

    request_id: RequestId
    prompt_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    params: SamplingParams
    origin: Name
    speculative: bool = True
    slo_tokens_per_s: SloRate | None = None  # token-speed SLO class (WISP batching); None: the verifier's default
    resume: ResumeState | None = None  # frontend only: continue after what was already relayed
    #: seconds the request had waited before this frame was sent (v8): since its coordinator took
    #: it (``QueuedRequest.created_at``, by the sender's wall clock). The verifier starts the
    #: request's SLO clock that much earlier (WISP's deadlines, the SLO counters), up to MAX_WAITED_S.
    waited_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class ResumeDone(_Msg, tag="resume_done", frozen=True):
    """Frontend -> verifier, once after each Welcome: every in-flight request this frontend
    re-opens has been sent (``sessions`` of them). Until then a drafter's OpenSession for a
    request of this frontend is answered ``busy``, so that it cannot start over a request whose
    tokens were already relayed."""

    sessions: Annotated[int, msgspec.Meta(ge=0)] = 0


class SessionOpened(_Msg, tag="session_opened", frozen=True):
    """The drafter may draft. A *resumed* session (its drafter left; another opens it again)
    carries the tokens the verifier committed so far and the round to draft for."""

    request_id: RequestId
    draft_budget: int  # how many tokens to draft for the first round (0: as in Verdict)
    committed_ids: list[TokenId] = []  # generated tokens already committed (resume only)
    round: Annotated[int, msgspec.Meta(ge=0)] = 0  # the round the first Draft is for
    #: the key of the verifier's coupled bonus tokens (shared.coupling), for a drafter that guesses
    #: them to draft ahead at temperature > 0; None: this verifier does not couple them
    bonus_key: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: (v7) every token of this sampled request is the winner of the race keyed by this (shared.race):
    #: draft each token by the same race over the draft model's distribution, ids only; None: the
    #: request is greedy, or sampled from the verifier's own stream (draft from q, send it)
    race_key: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Draft(_Msg, tag="draft", frozen=True):
    """Draft tokens for the next round, proposed after the session's committed tokens.

    ``q`` is None for ids-only drafts (treated as one-hot q: exact, and the cheap default) or
    one SparseQ per draft token when the drafter sampled from a known distribution.
    """

    request_id: RequestId
    round: Annotated[int, msgspec.Meta(ge=0)]
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_DRAFT_TOKENS)]
    q: Annotated[list[SparseQ], msgspec.Meta(max_length=MAX_DRAFT_TOKENS)] | None = None
    #: the draft model's probability of each drafted token, when it computed one (AdaSpec's
    #: confidence prior: the verifier's trim policy drops the least likely tail tokens)
    confidence: Annotated[list[Probability], msgspec.Meta(max_length=MAX_DRAFT_TOKENS)] | None = None
    #: the drafter chose to draft nothing (its controller expects no gain) and asks the verifier
    #: not to wait for it in the next this-many rounds: they run target-only at once (budget 0,
    #: as SmartSpec's switch-off), then the budget comes back and the drafter decides again
    pause_rounds: Annotated[int, msgspec.Meta(ge=0, le=MAX_PAUSE_ROUNDS)] = 0
    #: draw the token after a fully accepted draft by the race keyed by SessionOpened.bonus_key
    #: (shared.coupling): the drafter guesses it and drafts on from its guess
    guess_bonus: bool = False
    #: a *conditional* draft (v7; only to a verifier whose Welcome offers it): sent before the Verdict
    #: of ``round - 1``, it is this round's draft only if that round commits exactly these tokens
    #: (the drafter's lookahead guessed them); otherwise the verifier drops it without a word, and
    #: the drafter, seeing the Verdict, drafts the round afresh
    after: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_DRAFT_TOKENS + 1)] | None = None
    #: (v13) seconds the drafter's forwards took to draft these tokens (0: not timed, as for a
    #: lookahead's); with ``ahead``, what SmartSpec prices a draft's wait from (``draft_wait.Timed``)
    drafting_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    #: (v13) drafted during the previous round's verification (a lookahead that came true), and sent
    #: after its Verdict; a conditional draft (``after``) is one too
    ahead: bool = False


class Verdict(_Msg, tag="verdict", frozen=True):
    """The verifier's answer to one Draft.

    ``token_ids`` are the tokens committed this round: the first ``accepted`` drafts, then the
    verifier's own extra token (possibly cut short when a stop condition hit). A verifier may
    decode on while drafts travel (``--backend vllm`` always, the torch core when it fills), so a
    round may commit several tokens of its own, or tokens that equal drafts it never saw, first;
    ``accepted`` then counts the leading tokens that match the draft, wherever they came from.
    """

    request_id: RequestId
    round: int
    accepted: int
    token_ids: list[TokenId]
    finished: bool
    finish_reason: FinishReason | None
    #: tokens to draft next round; 0: send nothing, the verifier runs it target-only at once (its Verdict has the next)
    draft_budget: int


class CloseSession(_Msg, tag="close_session", frozen=True):
    request_id: RequestId
    reason: str = ""


class Cancel(_Msg, tag="cancel", frozen=True):
    """Frontend -> verifier: the client went away; stop the session and free its cache."""

    request_id: RequestId


class Release(_Msg, tag="release", frozen=True):
    """Frontend -> verifier (v9): this coordinator's client left, but may resume the stream
    elsewhere. The request keeps running unrelayed for ``Welcome.orphan_grace_s``, then is cancelled
    unless a coordinator adopted it; a finished one's events are kept as long."""

    request_id: RequestId


class Adopt(_Msg, tag="adopt", frozen=True):
    """Frontend -> verifier (v9): relay ``request_id`` to this coordinator from now on. Answered
    by Adopted, then every event the request had so far, in order, then its live events."""

    request_id: RequestId


#: live: open, its events follow; finished: done, its kept events follow; unknown: never opened
#: here (still queued, or on another verifier); gone: finished and no longer kept
AdoptState = Literal["live", "finished", "unknown", "gone"]


class Adopted(_Msg, tag="adopted", frozen=True):
    """Verifier -> frontend: the answer to Adopt. With ``live`` or ``finished``, the replayed events
    that follow are numbered ``first_seq`` .. ``last_seq`` (0 .. 0: none yet). A coordinator that
    sent Adopt for an ``unknown`` request opens it itself: the verifier routes a drafter's later
    OpenSession of it to the adopter."""

    request_id: RequestId
    state: AdoptState
    first_seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    last_seq: Annotated[int, msgspec.Meta(ge=0)] = 0


class ErrorFrame(_Msg, tag="error", frozen=True):
    """Something went wrong with one frame or one session. The link stays up."""

    code: str
    message: str
    request_id: str | None = None


# --- output (verifier -> frontend) ----------------------------------------------------------


class TokenEvent(_Msg, tag="token_event", frozen=True):
    """Tokens committed for one request since the last event, with the text they add."""

    request_id: RequestId
    origin: str
    token_ids: list[TokenId]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0  # cumulative for this request
    accepted_tokens: int = 0  # cumulative for this request
    error: str = ""
    #: one entry per token of ``token_ids`` when the request asked for logprobs, else None
    logprobs: list[TokenLogprob] | None = None
    #: with ``error``: the verifier's refusal code ("invalid": the request cannot be served as
    #: asked, a 400 to its client), else empty
    error_code: str = ""
    #: (v9) this event's place in its request's stream: 1, 2, ... (0: not numbered, e.g. a refusal);
    #: a coordinator's clients resume a stream after the last position they received
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0


class FleetStatus(_Msg, tag="fleet_status", frozen=True):
    drafters: list[str]
    sessions: int
    target_model: str
    #: the share of new requests the verifier's draft-length policy wants drafted for: 1 normally;
    #: 0 while SmartSpec finds plain decoding the better goodput at the load a new request will
    #: live through (its k = 0 at the most live sessions of a step in the last 2 s),
    #: and a coordinator in ``--speculation auto`` opens the others target-only
    draft_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0


# --- queue link (drafter <-> coordinator, in-process queue mode) ----------------------------


class QueuePull(_Msg, tag="queue_pull", frozen=True):
    """Ask for up to ``max_items`` requests; the server answers when it has at least one."""

    max_items: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    #: sessions the drafter can still take, this pull's included (0: not said); past every drafter's,
    #: a queued request starts target-only at once (``services/coordinator/queue_fallback.py``)
    room: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0


class QueueRoom(_Msg, tag="queue_room", frozen=True):
    """``QueuePull.room`` anew, when sessions ended while the pull waits; nothing is delivered."""

    room: Annotated[int, msgspec.Meta(ge=0, le=100_000)]


class QueueDelivery(_Msg, tag="queue_delivery", frozen=True):
    delivery_id: str
    request: QueuedRequest


class QueueAck(_Msg, tag="queue_ack", frozen=True):
    delivery_id: str


#: messages a Batch may carry
Batchable = Draft | Verdict | SessionOpened | TokenEvent | ErrorFrame | CloseSession | Cancel | Adopted
MAX_BATCH_ITEMS = 4096


class Batch(_Msg, tag="batch", frozen=True):
    """Several round-level messages for one peer, in order (see the module docstring)."""

    items: Annotated[list[Batchable], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


Message = (
    QueuedRequest
    | Hello
    | Welcome
    | Refused
    | OpenSession
    | ResumeDone
    | SessionOpened
    | Draft
    | Verdict
    | CloseSession
    | Cancel
    | Release
    | Adopt
    | Adopted
    | ErrorFrame
    | TokenEvent
    | FleetStatus
    | QueuePull
    | QueueRoom
    | QueueDelivery
    | QueueAck
    | Batch
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def encode_many(msgs: list[Batchable]) -> bytes:
    """One frame for several messages to the same peer: the message itself when there is one."""
    return _encoder.encode(msgs[0] if len(msgs) == 1 else Batch(items=msgs))


def unpack(msg: Message) -> list[Message]:
    """The messages a frame carries: a Batch's items, or the message itself."""
    return list(msg.items) if isinstance(msg, Batch) else [msg]


def decode(data: bytes | bytearray | memoryview | str, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Decode one frame, or raise ProtocolError saying what was wrong with it."""
    if isinstance(data, str):
        raise ProtocolError("text frame received; specfleet frames are binary MessagePack")
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed MessagePack: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # defensive: never crash
        raise ProtocolError(f"undecodable frame: {exc}") from None
