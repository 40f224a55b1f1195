"""Drafter configuration: every field is a CLI flag and a SPECFLEET_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt, section


@dataclass
class LinkSection:
    """links: the verifier and the request queue"""

    verifier_url: str = opt("ws://127.0.0.1:8100/v1/drafter",
                            "the verifier's drafter WebSocket endpoint; several replicas: a comma-separated list "
                            "(connects to one, moves to the next when it cannot reach it)")
    queue_url: str = opt(
        "ws://127.0.0.1:8000/internal/queue",
        "where requests come from: redis://host:6379/0 (Redis Streams) or the coordinator's "
        "ws://.../internal/queue (its in-process queue)",
    )
    queue_stream: str = opt("specfleet:requests", "Redis stream name (with a redis:// queue_url)")
    queue_group: str = opt("drafters", "Redis consumer group name (with a redis:// queue_url)")
    claim_idle_ms: int = opt(30000, "Redis: claim requests another drafter left pending this long")
    reconnect_s: float = opt(1.0, "seconds between reconnect attempts to the verifier or queue")


@dataclass
class SecuritySection:
    """security: credentials and TLS"""

    auth_token: str = opt("", "bearer token for the verifier and the coordinator's queue link: the fleet's shared "
                              "token, or this drafter's own token when the services use --credentials-file (then "
                              "--node-id must be the identity the token belongs to)")
    tls_ca: str = opt("", "PEM file of the certificate authorities to trust for wss:// links (pinning: only these, "
                          "not the system store); empty: the system store")
    require_tls: bool = opt(False, "refuse plaintext ws:// URLs for the verifier and the queue link (use on any "
                                   "network you do not control)")


@dataclass
class NodeSection:
    """this drafter: its name, metrics and logs"""

    node_id: str = opt("", "this drafter's name; empty picks drafter-<hostname>-<pid>")
    site: str = opt("", "the machine this drafter drafts on: the coordinator's queue gives a new request to a "
                        "drafter on its least loaded site and, among the drafters of one site (they share its "
                        "cores), to the one already serving the most, filling one batch before the next; empty: "
                        "this host's name (in Kubernetes, the node's name suits)")
    metrics_port: int = opt(0, "serve Prometheus /metrics, and /health and /ready for probes, on this port (0: off)")
    metrics_host: str = opt("127.0.0.1", "interface for /metrics (0.0.0.0 in containers)")
    log_level: str = opt("info", "debug, info, warning, error")


@dataclass
class ModelSection:
    """the draft model and what runs it"""

    model: str = opt("", "the draft model: a local Hugging Face directory, or a GGUF file run by llama.cpp (e.g. the "
                         "target's 4-bit copy that `specfleet fetch-model` makes)")
    device: str = opt("cpu", "torch device: cpu, cuda, ...")
    dtype: str = opt("auto", "a draft model directory's dtype: auto (as the verifier's --dtype auto), float32, "
                             "float16, bfloat16 (a GGUF file keeps its own)")
    runner: str = opt("auto", "model runner: auto (lean where the architecture allows), lean, hf")
    compute_mode: str = opt("auto", "where the draft model runs: thread (beside the event loop), inline (on it; best "
                                    "with one CPU), auto (inline when pinned to one CPU)")
    kv_cache_gb: float = opt(0.0, "draft KV cache in GiB; 0 sizes it for max_sessions full-context sessions (at "
                                  "most 20%% of RAM; a GGUF draft's at most 1 GiB, which llama.cpp commits at start)")
    lookup_rows: int = opt(3, "a draft model's greedy (or raced) step also feeds up to N tokens prompt lookup guesses "
                              "come next, and keeps those the model drafts too: several draft tokens from one forward "
                              "(proposers/draft_model.py; not on llama.cpp on a CPU, where a row costs a step, nor for "
                              "sessions a controller watches token by token); 0: off")
    next_tokens: str = opt("auto", "a step of one session with no prompt-lookup match feeds instead the token a table "
                                   "says most often follows its last two (shared/next_tokens.py): auto (the table "
                                   "`specfleet fetch-model` writes beside a GGUF copy, when there is one), a "
                                   "<target>.next-tokens.json file, or off; its guesses are looked-up rows, so "
                                   "--lookup-rows 0 (and llama.cpp on a CPU) leaves it unused")


@dataclass
class GgufSection:
    """threads, and what runs a GGUF draft"""

    torch_threads: int = opt(0, "torch intra-op threads; 0 leaves torch's default")
    gguf_backend: str = opt("auto", "what runs a GGUF draft: specfleet (its own 4-bit kernel: every matrix in Q4_1's "
                                    "blocks, a Q4_1 file's kept exactly; lean architectures on a CPU with AVX2), "
                                    "llama.cpp, or auto (specfleet for a Q4_1 or Q8_0 file on a CPU, the latter cut "
                                    "to 4 bits, else llama.cpp)")
    gguf_kv_cache: str = opt("float16", "the KV cache of a GGUF draft on specfleet's 4-bit kernel: float16 (half the "
                                        "bytes its attention reads per cached token, as llama.cpp keeps it) or "
                                        "float32")
    threads: int = opt(0, "a GGUF draft's llama.cpp threads; 0: --torch-threads, or when that is 0 too, every CPU "
                          "this process may run on")


@dataclass
class SessionSection:
    """sessions: how many, and how each is pipelined (StarSD)"""

    max_sessions: int = opt(4, "sessions served concurrently (requests taken from the queue at once)")
    admission: str = opt("max-sessions", "how many sessions to claim: max-sessions (up to --max-sessions), or starsd "
                                         "(also at most StarSD's N_max, estimated from measured timings)")
    pipeline_sessions: int = opt(2, "sessions draft their next round while this one is verified, while this drafter "
                                    "serves at most this many sessions (0: never; see bench/RESULTS.md): greedy and "
                                    "raced ones (the verifier's --sampling race, the default), and under --sampling "
                                    "stream unseeded sampled ones")
    lookahead_branches: int = opt(1, "a greedy or raced session alone on this drafter also drafts ahead for the N "
                                     "likeliest rejections of its draft in flight (the verifier committing the draft "
                                     "model's runner-up instead), in spare KV caches (0: only the all-accepted "
                                     "lookahead)")
    conditional_drafts: bool = opt(True, "send each lookahead to the verifier as soon as it is drafted, as the next "
                                         "round's draft on the condition that the verdict in flight comes out as it "
                                         "assumed, so a lookahead that comes true costs no round trip (when the "
                                         "verifier takes them, and the controller reads no draft features)")
    share_prefixes: bool = opt(True, "draft models: a session's draft cache takes the KV rows of the longest prefix of "
                                     "its text that another session's cache holds (a shared system prompt; the last "
                                     "closed session's cache is kept for it until its room is needed) instead of "
                                     "computing them; false: every session prefills its whole prompt")


@dataclass
class ProposalSection:
    """what proposes the drafts, and the q sent with them"""

    proposer: str = opt("auto", "what drafts: auto (gguf when --model is a .gguf file, else draft-model), "
                                "draft-model (--model is a draft LM directory), gguf (--model is a GGUF file, run by "
                                "llama.cpp), ngram (prompt lookup: no model; --model only provides the tokenizer, e.g. "
                                "the target's directory), or oracle (benchmarks: the target's recorded greedy output "
                                "at acceptance --oracle-alpha; --model provides the tokenizer)")
    ngram_max: int = opt(4, "proposer=ngram: longest n-gram to match")
    ngram_min: int = opt(1, "proposer=ngram: shortest n-gram to match")
    draft_mode: str = opt("sampled", "sampled: a sampled request is drafted from its own distribution, as the "
                                     "winner of the verifier's keyed race (ids only) under race sampling, or with its "
                                     "nucleus on the wire as q under stream sampling; greedy requests get argmax ids. "
                                     "greedy: argmax ids for every request (the baseline)")
    q_mass: float = opt(0.98, "sampled drafts: keep the draft distribution's most likely tokens up to this mass")
    q_max_entries: int = opt(4096, "sampled drafts: but at most this many tokens per position (6 bytes each; "
                                   "lower it for slow links, see bench/results/qwire.md)")
    oracle_file: str = opt("", "proposer=oracle: the reference file, JSON lines {prompt_ids, output_ids} recorded "
                               "from a target-only pass (python -m bench oracle-record)")
    oracle_alpha: float = opt(0.8, "proposer=oracle: each draft token is the reference's with this probability")


@dataclass
class ControlSection:
    """when to stop drafting within the budget (WISP, AdaSpec)"""

    controller: str = opt("fixed", "when to stop drafting within the verifier's budget: fixed (draft it all, the "
                                   "baseline), threshold (stop after a token the draft model is unsure of), adaspec "
                                   "(stop when one more token would lower expected tokens per second), or wisp (stop "
                                   "at the first token an MLP on the draft's logit statistics predicts rejected)")
    threshold: float = opt(0.4, "controller=threshold: stop when the draft's top probability is below this")
    wisp_model: str = opt("", "controller=wisp: start from this predictor (written by `specfleet wisp-train`); "
                              "empty: draft the whole budget until one is trained in the background")
    wisp_train_after: int = opt(2000, "controller=wisp: retrain the predictor in the background after this many "
                                      "new labelled tokens (0: never; keep --wisp-model as it is)")
    wisp_samples: str = opt("", "controller=wisp: append every labelled token (features, accepted) to this CSV, "
                                "the input of `specfleet wisp-train`")
    send_confidence: bool = opt(False, "send each draft token's draft-model probability with the draft (the "
                                       "verifier's --trim adaspec reads it; sent anyway with a controller that "
                                       "computes it: threshold, adaspec, wisp)")


@dataclass
class DrafterConfig:
    """specfleet drafter: runs a small draft model and proposes tokens for many sessions."""

    links: LinkSection = section(LinkSection)
    security: SecuritySection = section(SecuritySection)
    node: NodeSection = section(NodeSection)
    draft_model: ModelSection = section(ModelSection)
    gguf: GgufSection = section(GgufSection)
    sessions: SessionSection = section(SessionSection)
    proposal: ProposalSection = section(ProposalSection)
    control: ControlSection = section(ControlSection)
