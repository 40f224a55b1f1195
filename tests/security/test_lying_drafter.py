"""A drafter that lies about q biases sampled output when trusted, and cannot when untrusted (nor,
under race sampling, when trusted).

The liar draws its token uniformly at random but claims, as q, the target's own distribution p:
a trusted q makes every draft's acceptance probability min(1, p/q) = 1, so the output follows
the liar's uniform choice. An untrusted drafter's q is dropped by the verifier's intake, and
ids-only verification (q one-hot) gives exactly p however the tokens were chosen.

The frames go through the verifier's real intake (ownership and trust checks, q parsing) and the
real batched acceptance step (``judge``) over thousands of sessions at once; a chi-square test
then compares the first output token's distribution with p.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from services.verifier.core_api import AddDraft, Admitted, Attached
from services.verifier.intake import Intake
from services.verifier.judge import judge
from services.verifier.metrics import VerifierMetrics
from services.verifier.output import Output
from services.verifier.sessions import Route, Routes
from shared.draft_q import pack
from shared.protocol import Draft, SamplingParams, SessionOpened
from shared.sampling import probs_from_logits
from tests.e2e.lossless_stats import chi_square_p
from tests.verifier_requests import make_request

VOCAB = 12
SESSIONS = 4000
PARAMS = SamplingParams(temperature=1.0, max_tokens=4)
ALPHA = 1e-3


class CoreInbox:
    """The engine core's command intake, as the verifier's Intake sees it: it records AddDrafts."""

    vocab_size = VOCAB
    max_model_len = 512

    def __init__(self) -> None:
        self.drafts: dict[str, AddDraft] = {}

    def submit(self, command: Any) -> None:
        assert isinstance(command, AddDraft), command
        self.drafts[command.request_id] = command


class NoErrors:
    def error(self, conn_id: str, code: str, message: str, rid: str | None) -> None:
        raise AssertionError(f"intake refused a frame from {conn_id}: {code}: {message}")


def first_tokens(trusted: bool, logits: torch.Tensor, p: torch.Tensor, race: bool = False) -> list[int]:
    """The first output token of SESSIONS sessions drafted by the liar over one connection (with
    ``race``, under race sampling: shared.race)."""
    core, routes = CoreInbox(), Routes(SESSIONS + 1)
    conn = "drafter-1"
    intake = Intake(core, routes, NoErrors(), None, trusted=lambda c: trusted and c == conn)  # type: ignore[arg-type]
    claimed = pack(torch.arange(VOCAB), p.half())  # "I sampled from p": the lie
    liar = torch.Generator().manual_seed(7)
    for i in range(SESSIONS):
        rid = f"s{i}"
        routes.add(Route(rid, "frontend", conn, conn, conn, 3, None))  # type: ignore[arg-type]
        token = int(torch.randint(0, VOCAB, (1,), generator=liar))  # how it really chose: uniformly
        intake.handle(conn, "drafter", Draft(request_id=rid, round=0, token_ids=[token], q=[claimed]))
    batch = []
    for i in range(SESSIONS):
        add = core.drafts[f"s{i}"]
        req = make_request(add.request_id, [1, 2, 3], SamplingParams(temperature=1.0, seed=1000 + i), True, 512,
                             frozenset(), race=race)
        req.round.draft.q = add.q  # what the core would verify with: the parsed q, or None (ids-only)
        assert (add.q is not None) == trusted
        batch.append((req, add.token_ids))
    rows = logits.repeat(SESSIONS * 2, 1)  # each session: its draft position, then the bonus row
    return [v.tokens[0] for v in judge(batch, rows)]


def test_lying_drafter_biases_only_when_trusted() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    p = probs_from_logits(logits, PARAMS)
    trusted = first_tokens(True, logits, p)
    untrusted = first_tokens(False, logits, p)
    p_trusted = chi_square_p(Counter(trusted), p.tolist(), SESSIONS)
    p_untrusted = chi_square_p(Counter(untrusted), p.tolist(), SESSIONS)
    assert p_trusted < 1e-12, f"the trusted liar should bias the output (chi-square p = {p_trusted:.3g})"
    assert p_untrusted > ALPHA, f"ids-only verification must follow p (chi-square p = {p_untrusted:.3g})"
    # and the bias is the liar's: trusted output is close to uniform, not to p
    uniform_p = chi_square_p(Counter(trusted), [1 / VOCAB] * VOCAB, SESSIONS)
    assert uniform_p > ALPHA, uniform_p


def test_under_race_sampling_even_a_trusted_liar_cannot_bias_the_output() -> None:
    """Every token is the race winner over p (shared.race): a draft only decides how much of it is
    verified at once, so what a drafter claims about q, or how it chose its tokens, changes nothing."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    p = probs_from_logits(logits, PARAMS)
    raced = first_tokens(True, logits, p, race=True)
    p_raced = chi_square_p(Counter(raced), p.tolist(), SESSIONS)
    assert p_raced > ALPHA, f"race sampling must follow p whatever the drafter does (chi-square p = {p_raced:.3g})"


def test_only_a_trusted_drafter_may_ask_for_the_raced_bonus() -> None:
    """A drafter knows the variates of the verifier's race for its bonus token (shared.coupling)
    and could choose draft lengths to steer it: an untrusted drafter's ask is ignored."""
    for trusted in (True, False):
        core, routes, conn = CoreInbox(), Routes(2), "drafter-1"
        intake = Intake(core, routes, NoErrors(), None, trusted=lambda _c, t=trusted: t)  # type: ignore[arg-type]
        routes.add(Route("s0", "frontend", conn, conn, conn, 3, None))  # type: ignore[arg-type]
        intake.handle(conn, "drafter", Draft(request_id="s0", round=0, token_ids=[1], guess_bonus=True))
        assert core.drafts["s0"].asks.guess_bonus is trusted


class Sent:
    """The connection registry as the verifier's Output sees it: it records frames per connection."""

    def __init__(self, trusted: bool) -> None:
        self.frames: dict[str, list[Any]] = {}
        self._trusted = trusted

    def send(self, conn_id: str, msgs: list[Any]) -> None:
        self.frames.setdefault(conn_id, []).extend(msgs)

    def send_frontend(self, origin: str, msgs: list[Any]) -> None:
        pass

    def trusted(self, conn_id: str) -> bool:
        return self._trusted


def test_only_a_trusted_drafter_hears_the_bonus_key() -> None:
    """An untrusted drafter's ask for the race is ignored, so it gets no key to guess with: its
    lookaheads could never be used (on open and on resume alike)."""
    for trusted in (True, False):
        peers, routes, conn = Sent(trusted), Routes(2), "drafter-1"
        output = Output(peers, routes, VerifierMetrics())  # type: ignore[arg-type]
        routes.add(Route("s0", "frontend", conn, conn, conn, 3, None))  # type: ignore[arg-type]
        output.on_results([Admitted("s0", 4, bonus_key=1234), Attached("s0", [5], 1, 4, bonus_key=1234)])
        opened = [m for m in peers.frames[conn] if isinstance(m, SessionOpened)]
        assert len(opened) == 2
        assert all(m.bonus_key == (1234 if trusted else None) for m in opened), opened


def test_a_resuming_drafter_is_judged_on_its_own_trust() -> None:
    """The key on resume goes by the resuming drafter's trust, not by the opener's."""
    peers, routes = Sent(True), Routes(2)
    peers.trusted = lambda conn_id: conn_id == "opener"  # type: ignore[method-assign]
    output = Output(peers, routes, VerifierMetrics())  # type: ignore[arg-type]
    routes.add(Route("s0", "frontend", "opener", "resumer", "opener", 3, None))  # type: ignore[arg-type]
    output.on_results([Attached("s0", [5], 1, 4, bonus_key=1234)])
    (opened,) = [m for m in peers.frames["resumer"] if isinstance(m, SessionOpened)]
    assert opened.bonus_key is None
    routes.get("s0").drafter = "opener"  # type: ignore[union-attr]
    output.on_results([Attached("s0", [5], 1, 4, bonus_key=1234)])
    (opened,) = [m for m in peers.frames["opener"] if isinstance(m, SessionOpened)]
    assert opened.bonus_key == 1234
