"""Verifier configuration: every field is a CLI flag and a SPECFLEET_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from services.verifier.allocation import POLICIES as ALLOCATIONS
from services.verifier.batching import POLICIES as BATCHINGS
from services.verifier.trim import POLICIES as TRIMS
from shared.config import ConfigError, flag_name, flat, opt, section
from shared.runner import RUNNER_KINDS
from shared.runner.matmul import KERNELS


@dataclass
class ServerSection:
    """serving: where the verifier listens, and how it watches its peers"""

    host: str = opt("127.0.0.1", "interface to listen on (0.0.0.0 in containers)")
    port: int = opt(8100, "TCP port for the drafter and frontend WebSocket endpoints")
    ws_ping_interval_s: float = opt(10.0, "send every peer (drafters and coordinators) a WebSocket ping this often, "
                                          "so a peer that vanished without closing its connection (power loss, a cut "
                                          "link, a hung process) is noticed")
    ws_ping_timeout_s: float = opt(20.0, "drop a peer's connection when its pong is this late: a drafter's sessions "
                                         "continue target-only, a coordinator's requests are cancelled as for one "
                                         "that died. Keep it above the longest stall of either side's event loop")
    log_level: str = opt("info", "debug, info, warning, error")


@dataclass
class SecuritySection:
    """security: who may connect, and over what"""

    auth_token: str = opt("", "bearer token peers must present; empty disables auth (loopback only!). With "
                              "--credentials-file it admits frontends (coordinators) only")
    credentials_file: str = opt("", "per-drafter credentials (JSON: id, token or token_sha256, trusted), re-read "
                                    "when it changes; a removed entry is revoked at once (see README, Security)")
    drafter_trust: str = opt("trusted", "whether drafters admitted by the shared --auth-token are believed about q: "
                                        "trusted (q is used), untrusted (drafts are verified ids-only, lossless "
                                        "however the tokens were chosen); credentials-file drafters say their own")
    tls_cert: str = opt("", "PEM certificate chain: serve wss:// (with --tls-key); empty: plaintext ws://")
    tls_key: str = opt("", "PEM private key of --tls-cert")


@dataclass
class TargetSection:
    """the target model and what runs it"""

    model: str = opt("", "local Hugging Face directory of the target model")
    backend: str = opt("torch", "what runs the target: torch (specfleet's own engine: every policy applies), vllm "
                                "(vLLM verifies with its own scheduler and KV cache; pip install -e '.[vllm]')")
    vllm_memory_share: float = opt(0.0, "backend=vllm: vLLM's gpu_memory_utilization (on a CPU, the share of RAM "
                                        "for its KV cache); 0: 0.2 on CPU, 0.9 on CUDA")
    tensor_parallel_size: int = opt(1, "backend=vllm: GPUs the target is split over (vLLM tensor parallelism)")
    device: str = opt("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = opt("auto", "auto (a checkpoint stored in float32 runs in float32; any other in bfloat16 on CUDA "
                             "and on CPUs with native bfloat16, AVX512-BF16 or AMX, float32 on other CPUs), "
                             "float32, float16, bfloat16")
    max_model_len: int = opt(0, "context limit in tokens; 0 takes the model's max_position_embeddings")
    torch_threads: int = opt(0, "torch intra-op threads; 0 leaves torch's default")


@dataclass
class EngineSection:
    """the torch engine core"""

    runner: str = opt("auto", "model runner: auto (lean where the architecture allows), lean, hf")
    matmul: str = opt("auto", "the lean runner's matmul kernel: auto (rowwise where it builds; else onednn, "
                              "else plain), rowwise (specfleet's kernel: float32 sums, batch-invariant by "
                              "construction, each block one C++ call, bfloat16 on AVX512-BF16's dot product; built "
                              "once with g++), onednn (reordered weights), plain (F.linear)")
    core_mode: str = opt("auto", "engine core: thread (overlaps network I/O with the model), inline (on the event "
                                 "loop; best with one CPU), auto (inline when pinned to one CPU)")
    batch_invariant: bool = opt(True, "compute every position's logits bitwise the same whatever the step's shape "
                                      "(attention over whole key blocks, matmuls over enough rows), so speculation "
                                      "never changes the text, in any dtype; proven at start-up (backend=torch, lean "
                                      "runner)")
    estimator_file: str = opt("", "step-time coefficients from `make profile-verifier` (refined online); empty: "
                                  "calibrate at start-up (see calibrate_estimator)")
    calibrate_estimator: bool = opt(True, "without an estimator file, time 16 batch shapes on the served runner "
                                          "at start-up (about 4 s on the default target) and fit the step-time "
                                          "estimator on them; false: start from a generic CPU guess (backend=torch)")
    recompute_context: bool = opt(False, "benchmark baseline (SLED-like): forget each session's cached keys and "
                                         "values after every round, so the next round recomputes its whole context; "
                                         "never for serving (backend=torch only)")
    share_prefixes: bool = opt(True, "copy the KV rows of a prompt prefix another live request already computed "
                                     "(n > 1, shared system prompts) instead of computing them again (backend=torch)")


@dataclass
class CapacitySection:
    """capacity: sessions held, a step's size, and a round's drafts"""

    kv_cache_gb: float = opt(0.0, "KV cache in GiB; 0: 20%% of RAM, at most 2 GiB, on CPU; 80%% of free GPU memory")
    max_sessions: int = opt(256, "most sessions held at once (running or waiting); further ones are refused as busy")
    max_waiting: int = opt(256, "sessions held waiting for KV memory; beyond that new sessions are refused as busy")
    max_batch_sessions: int = opt(32, "most sessions verified in one batched forward pass")
    max_batch_tokens: int = opt(2048, "most tokens in one forward pass (rounds' new tokens plus prefill chunks)")
    prefill_chunk: int = opt(256, "most prompt tokens prefilled in a step that also verifies rounds (chunked prefill)")
    draft_capacity: int = opt(0, "GoodSpeed's C: draft tokens per round over all sessions (fixed gives C/N each, "
                                 "random a random split); 0: --draft-len per speculating session")


@dataclass
class RoundSection:
    """rounds: drafts, how long to wait for them, how tokens are drawn"""

    draft_len: int = opt(4, "draft tokens per round given to each session (Fixed-S), and the adaptive "
                            "policies' first length")
    max_draft_tokens: int = opt(16, "upper bound on any session's draft budget")
    draft_timeout_s: float = opt(30.0, "a session whose drafter sends no draft this long continues target-only")
    resume_grace_s: float = opt(30.0, "after start-up, a drafter's OpenSession for a coordinator that has not yet "
                                "re-opened its in-flight requests here is answered busy (retried) for up to this long, "
                                "so no request starts over after a verifier restart; 0: never wait")
    orphan_grace_s: float = opt(30.0, "a request whose coordinator left (it died, or its client disconnected) keeps "
                                "running this long, and a finished request's events are kept this long, so that "
                                "its client can resume the stream through any coordinator; then it is cancelled. "
                                "0: cancel at once, keep nothing")
    sampling: str = opt("race", "how a sampled request's tokens are drawn: race (each the winner of a race keyed "
                                "by the request: drafters draft the same races over their own distribution and send "
                                "ids only; a seeded request's text is the same with or without speculation; "
                                "shared.race), or stream (from the request's own random stream; drafters send q)")
    fill: bool = opt(True, "when a step has no draft to verify, decode greedy and raced sessions whose drafts are on "
                           "their way (one token each; verifying their drafts would commit the same tokens), as long "
                           "as no draft is expected before the step would end (backend=torch)")
    fill_riders: bool = opt(True, "with --fill: a step that verifies other sessions also decodes one token for each "
                                  "waiting greedy or raced session it has room for (it runs anyway, and a draft that "
                                  "comes during it waits for it); false: only steps with nothing to verify fill")


@dataclass
class AllocationSection:
    """draft-length allocation (GoodSpeed, SmartSpec)"""

    allocation: str = opt("smartspec-per-drafter", "draft-length allocation: fixed (Fixed-S), random (Random-S), "
                                                   "goodspeed (gradient scheduling of a global budget for "
                                                   "proportional fairness), smartspec (the length "
                                                   "0..--smartspec-max-len that maximises goodput on one acceptance "
                                                   "rate over every session; 0 turns speculation off), "
                                                   "smartspec-per-drafter (the same on each drafter's own acceptance "
                                                   "and draft waits, so a poor drafter is asked for nothing)")
    goodspeed_eta: float = opt(0.1, "GoodSpeed's η: smoothing of each session's acceptance estimate α̂ (eq. 3)")
    goodspeed_beta: float = opt(0.5, "GoodSpeed's β: smoothing of each session's goodput X (eq. 4)")
    smartspec_max_len: int = opt(8, "SmartSpec's V: the longest proposal length it considers")
    smartspec_overhead: bool = opt(True, "SmartSpec prices a round with the verifier's measured busy time between "
                                         "forwards (per step and per session) as well as the forward; false: the "
                                         "paper's forward-only batch time")
    smartspec_timed_waits: bool = opt(True, "SmartSpec prices a draft's wait from the drafter's own timing of its "
                                            "drafts (network, drafting per token, lookaheads that finish within "
                                            "the verification); false: a measured level per load plus a slope in "
                                            "the draft's length, which reads 0 while every draft has one length")
    speculation_guard: bool = opt(True, "with a smartspec allocation: switch speculation off (every budget 0, no "
                                        "new request drafted for) at a load (live sessions 1, 2-3, 4-7, ...) where "
                                        "the tokens served per second fell below what target-only decoding of the "
                                        "same sessions would serve (2.5 s windows averaged since it came on there, "
                                        "priced by the verifier's own target-only steps), and try again after "
                                        "8-64 s (backend=torch); false: the policy alone")
    allocation_seed: int = opt(-1, "allocation=random: seed of the random splits (-1: unseeded)")


@dataclass
class BatchingSection:
    """batch selection (WISP) and draft trimming (AdaSpec)"""

    batching: str = opt("fcfs", "batch selection: fcfs (oldest ready first), wisp (SLO-aware: requests past their "
                                "latest start first by deadline, then by utility density, within deadlines)")
    slo_tokens_per_s: float = opt(0.0, "SLO class (tokens/s) of requests that name none (extension field "
                                       "slo_tokens_per_s); 0: best effort")
    wisp_delta_ms: float = opt(20.0, "batching=wisp: guard time δ subtracted from each latest start time")
    wisp_network_ms: float = opt(0.0, "batching=wisp: T_network of eq. 6, the part of a request's time that this "
                                      "server cannot see, taken off every deadline: the client's hop to its "
                                      "coordinator and each token's delivery back, plus a safety margin (the "
                                      "queue and the edge before the session opens here count already: "
                                      "OpenSession.waited_s)")
    trim: str = opt("none", "draft trim: none, adaspec (drop the least likely tail drafts while that raises the "
                            "batch's estimated tokens per second; needs drafters that send confidences)")
    tpot_slo_ms: float = opt(0.0, "trim=adaspec: refuse batch shapes whose predicted step exceeds this (0: off)")


@dataclass
class VerifierConfig:
    """specfleet verifier: runs the target model and verifies drafts from many drafters in batches."""

    server: ServerSection = section(ServerSection)
    security: SecuritySection = section(SecuritySection)
    target: TargetSection = section(TargetSection)
    engine: EngineSection = section(EngineSection)
    capacity: CapacitySection = section(CapacitySection)
    rounds: RoundSection = section(RoundSection)
    budgets: AllocationSection = section(AllocationSection)
    batches: BatchingSection = section(BatchingSection)


BACKENDS = ("torch", "vllm")
SAMPLINGS = ("race", "stream")  # backend=vllm samples its own way: stream
CORE_MODES = ("auto", "thread", "inline")
TRUST_MODES = ("trusted", "untrusted")
#: the flags that take one of a few words, and those words
CHOICES: dict[str, tuple[str, ...]] = {
    "backend": BACKENDS, "sampling": SAMPLINGS, "core_mode": CORE_MODES, "runner": RUNNER_KINDS, "matmul": KERNELS,
    "drafter_trust": TRUST_MODES, "allocation": ALLOCATIONS, "batching": BATCHINGS, "trim": TRIMS,
    "dtype": ("auto", "float32", "float16", "bfloat16"),
}
#: the flags that must be above zero
POSITIVE = ("max_sessions", "max_batch_sessions", "max_batch_tokens", "prefill_chunk", "ws_ping_interval_s",
            "ws_ping_timeout_s", "draft_timeout_s", "tensor_parallel_size")
#: the flags that must not be below zero
NON_NEGATIVE = ("port", "vllm_memory_share", "max_model_len", "kv_cache_gb", "max_waiting", "draft_len",
                "draft_capacity", "resume_grace_s", "orphan_grace_s", "slo_tokens_per_s", "wisp_delta_ms",
                "wisp_network_ms", "tpot_slo_ms", "torch_threads", "max_draft_tokens",
                "smartspec_max_len")  # 0: no drafts


def validate(cfg: VerifierConfig) -> None:
    """Every problem with the flags at once, as one ConfigError, before anything is loaded."""
    problems = [*_word_problems(cfg), *_range_problems(cfg)]
    if not cfg.target.model:
        problems.append("no target model given: pass --model DIR or set SPECFLEET_MODEL")
    if bool(cfg.security.tls_cert) != bool(cfg.security.tls_key):
        problems.append("--tls-cert and --tls-key go together: give both (wss://) or neither (ws://)")
    torch_only = cfg.batches.batching != "fcfs" or cfg.batches.trim != "none" or cfg.engine.recompute_context
    if cfg.target.backend == "vllm" and torch_only:
        problems.append("--batching, --trim and --recompute-context apply to the torch backend only: vLLM's own "
                        "scheduler forms the batches and keeps the KV cache; leave them at fcfs, none and false "
                        "with --backend vllm")
    if problems:
        raise ConfigError("; ".join(problems))


def _word_problems(cfg: VerifierConfig) -> list[str]:
    values = flat(cfg)
    return [f"{flag_name(name)} must be one of {', '.join(allowed)}, got {values[name]!r}"
            for name, allowed in CHOICES.items() if values[name] not in allowed]


def _range_problems(cfg: VerifierConfig) -> list[str]:
    values = flat(cfg)
    return ([f"{flag_name(n)} must be > 0, got {values[n]}" for n in POSITIVE if values[n] <= 0]
            + [f"{flag_name(n)} must be >= 0, got {values[n]}" for n in NON_NEGATIVE if values[n] < 0])
