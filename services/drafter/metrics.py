"""Prometheus metrics of one drafter: where each of its rounds' time goes.

A round, seen from the drafter: wait for the draft model (``worker_wait``: StarSD's queueing
T_wait), draft (``draft``: the batch's forwards and sampling), send the Draft (``send``), then
wait for the Verdict (``verify_wait``: both network legs plus the verifier's queue, forward and
publish). ``round`` is the whole of it. The model's busy and idle seconds give its idle fraction
(T_idle); ``draft_batch_sessions`` how many sessions each forward of a round batch drafted (a batch
of rounds runs forward by forward, sessions joining and leaving), and each lookahead batch. Served
on ``--metrics-port`` (0 leaves it off).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from shared.log import get_logger

log = get_logger("drafter.metrics")
_P = "specfleet_drafter"
_TIME = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
         0.25, 0.5, 1.0, 2.5)


class DrafterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.phase = Histogram(f"{_P}_round_phase_seconds", "Round time by phase: worker_wait, draft, send, "
                               "verify_wait, round", ["phase"], buckets=_TIME, registry=r)
        self.rounds = Counter(f"{_P}_rounds", "Rounds played", registry=r)
        self.committed = Counter(f"{_P}_committed_tokens", "Tokens the verifier committed for this drafter's "
                                 "sessions: drafted rounds, rounds it ran target-only (budget 0) and fills",
                                 registry=r)
        self.drafted = Counter(f"{_P}_drafted_tokens", "Draft tokens sent", registry=r)
        self.round_drafted = Counter(f"{_P}_round_drafted_tokens", "Draft tokens sent by rounds the draft model "
                                     "drafted then (not taken from a lookahead): what its round busy time, "
                                     "model_busy less lookahead_busy, drafted", registry=r)
        self.asked = Counter(f"{_P}_asked_tokens", "Draft tokens the rounds asked their proposer for (the "
                             "budget, cut to what the request can still use, to what the controller wanted and, "
                             "in a round drafted ahead, to what its lookahead asked for); a model-free proposer "
                             "sends fewer when its match runs out", registry=r)
        self.accepted = Counter(f"{_P}_accepted_tokens", "Draft tokens the verifier accepted", registry=r)
        self.sessions = Gauge(f"{_P}_sessions", "Sessions being served", registry=r)
        self.lookahead = Counter(f"{_P}_lookaheads", "Pipelined drafts by outcome: used (the verdict made one "
                                 "true), missed (the verdict's outcome had a lookahead, but its guessed token was "
                                 "wrong or nothing was past it), dropped (no lookahead assumed the verdict's "
                                 "outcome, or the session finished)",
                                 ["outcome"], registry=r)
        self.presented = Counter(f"{_P}_presented_lookaheads", "Used lookaheads the verifier already held, sent as a "
                                 "conditional Draft before the verdict they assumed (no round trip)", registry=r)
        self.alternative_used = Counter(f"{_P}_alternative_lookaheads_used", "Used lookaheads that assumed a "
                                        "rejected draft (--lookahead-branches); also counted in lookaheads{used}",
                                        registry=r)
        self.n_full = Gauge(f"{_P}_n_full", "StarSD's N_full: sessions from which the draft model never idles "
                            "(0 until estimated)", registry=r)
        self.n_max = Gauge(f"{_P}_n_max", "StarSD's N_max: the most sessions this drafter claims (0 until "
                           "estimated)", registry=r)
        self.resumed = Counter(f"{_P}_sessions_resumed", "Sessions taken over from a drafter that left, from "
                               "their committed text", registry=r)
        self.draft_busy = Counter(f"{_P}_model_busy_seconds", "Time the draft model spent drafting", registry=r)
        self.lookahead_busy = Counter(f"{_P}_lookahead_busy_seconds", "Time the draft model spent drafting "
                                      "lookaheads (pipelined drafting; also in model_busy)", registry=r)
        self.draft_cpu = Counter(f"{_P}_model_cpu_seconds", "CPU time of the draft model's batches (its compute "
                                 "thread's; below model_busy when other processes share its core)", registry=r)
        self.lookahead_cpu = Counter(f"{_P}_lookahead_cpu_seconds", "CPU time of the draft model's lookahead "
                                     "batches (also in model_cpu)", registry=r)
        self.draft_idle = Counter(f"{_P}_model_idle_seconds", "Time the draft model waited for a ready session "
                                  "(StarSD's T_idle)", registry=r)
        self.shared_prefix = Counter(f"{_P}_shared_prefix_tokens", "Tokens a session's draft cache took from "
                                     "another session's (a shared system prompt, on a first draft) instead of "
                                     "computing them", registry=r)
        self.looked_up = Counter(f"{_P}_looked_up_rows", "Rows a draft step fed for the tokens prompt lookup "
                                 "(or the next-token table, --next-tokens) guessed would follow (--lookup-rows), "
                                 "by outcome: kept (the draft model drafted them too, without a forward of their "
                                 "own) or dropped", ["outcome"], registry=r)
        self.job_wait = Histogram(f"{_P}_job_wait_seconds", "A ready session's wait for the draft model (StarSD's "
                                  "T_wait)", buckets=_TIME, registry=r)
        self.batch_size = Histogram(f"{_P}_draft_batch_sessions", "Sessions drafted together in one forward "
                                    "(a batch of rounds runs forward by forward, sessions joining and leaving) or "
                                    "batch (lookaheads), by kind: round or lookahead", ["kind"],
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)

    def observe_round(self, worker_wait: float, draft: float, send: float, verify_wait: float, asked: int,
                      drafted: int, accepted: int, from_lookahead: bool = False) -> None:
        self.phase.labels("worker_wait").observe(worker_wait)
        self.phase.labels("draft").observe(draft)
        self.phase.labels("send").observe(send)
        self.phase.labels("verify_wait").observe(verify_wait)
        self.phase.labels("round").observe(worker_wait + draft + send + verify_wait)
        self.rounds.inc()
        self.asked.inc(asked)
        self.drafted.inc(drafted)
        if not from_lookahead:
            self.round_drafted.inc(drafted)
        self.accepted.inc(accepted)

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics on a background thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(server.server_port)
        log.info("metrics served", host=host, port=bound)
        return bound
