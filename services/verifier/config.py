"""Verifier configuration: every field is a CLI flag and a SPECFLEET_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class VerifierConfig:
    """specfleet verifier: runs the target model and verifies drafts from many drafters in batches."""

    host: str = opt("127.0.0.1", "interface to listen on (0.0.0.0 in containers)")
    port: int = opt(8100, "TCP port for the drafter and frontend WebSocket endpoints")
    model: str = opt("", "local Hugging Face directory of the target model")
    device: str = opt("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = opt("auto", "auto (float32 on CPU, bfloat16 on CUDA), float32, float16, bfloat16")
    max_model_len: int = opt(0, "context limit in tokens; 0 takes the model's max_position_embeddings")
    auth_token: str = opt("", "bearer token peers must present; empty disables auth (loopback only!)")
    max_sessions: int = opt(256, "most sessions held at once (running or waiting); further ones are refused as busy")
    max_batch_sessions: int = opt(32, "most sessions verified in one batched forward pass")
    max_batch_tokens: int = opt(2048, "most tokens in one forward pass (rounds' new tokens plus prefill chunks)")
    prefill_chunk: int = opt(256, "most prompt tokens prefilled in a step that also verifies rounds (chunked prefill)")
    kv_cache_gb: float = opt(0.0, "KV cache in GiB; 0: 20%% of RAM, at most 2 GiB, on CPU; 80%% of free GPU memory")
    max_waiting: int = opt(256, "sessions held waiting for KV memory; beyond that new sessions are refused as busy")
    runner: str = opt("auto", "model runner: auto (lean where the architecture allows), lean, hf")
    core_mode: str = opt("auto", "engine core: thread (overlaps network I/O with the model), inline (on the event "
                                 "loop; best with one CPU), auto (inline when pinned to one CPU)")
    draft_len: int = opt(4, "draft tokens per round given to each session (Fixed-S allocation)")
    max_draft_tokens: int = opt(16, "upper bound on any session's draft budget")
    draft_timeout_s: float = opt(30.0, "a session whose drafter sends no draft this long continues target-only")
    allocation: str = opt("fixed", "draft-length allocation policy: fixed")
    batching: str = opt("fcfs", "batch selection policy: fcfs")
    torch_threads: int = opt(0, "torch intra-op threads; 0 leaves torch's default")
    log_level: str = opt("info", "debug, info, warning, error")
