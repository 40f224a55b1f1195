"""A GGUF model run by llama.cpp, behind the same small surface as :class:`ModelRunner`.

The draft-model proposer drafts through three things of its runner: ``forward`` over packed
segments, ``kv`` (an arena of per-session slots that roll back by truncation and share prefix
rows), and the model's limits. Here they are one llama.cpp context and its KV cache:

* a slot is a llama.cpp *sequence* of that one context (StarSD §3: one drafter, many sessions,
  each session's cache isolated by its tag). All sequences share the context's cells
  (``kv_unified``), so a session uses only the cells it fills;
* ``forward`` is one ``llama_decode`` over a batch holding every segment's new tokens, each in
  its own sequence at its own positions, with logits asked for only where the caller wants them;
* rolling a slot back removes its cells past the kept length (``llama_memory_seq_rm``); sharing a
  prefix with a spare (a lookahead branch) tags the same cells with the spare's sequence too
  (``llama_memory_seq_cp``): no copy.

The arena accounts capacity in tokens, as :class:`~shared.runner.kv.KVArena` does, against the
context's cells, so a session is refused cleanly (drafts nothing) when there is no room.

``llama-cpp-python`` is an optional dependency: :func:`load_llama` raises ModelLoadError with
what to install when it is missing.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.gguf_files import GgufInfo, read_gguf
from shared.llama_lib import gpu_present, llama_cpp_module
from shared.log import get_logger
from shared.models import ModelLoadError
from shared.runner.kv import KVError, KVSlot
from shared.runner.step import Segment

log = get_logger("runner.llama")
#: tokens per llama_decode call asked for: longer feeds (a long prompt's first draft) go in several calls
BATCH_TOKENS = 512


@dataclass(eq=False)
class SeqSlot(KVSlot):
    """A session's llama.cpp sequence: ``length`` cells hold its positions 0..length-1."""

    seq: int = 0
    arena: SeqArena | None = None

    def truncate(self, length: int) -> None:
        super().truncate(length)
        if self.arena is not None:
            self.arena.forget(self.seq, length)


class SeqArena:
    """The llama.cpp sequences of one context, handed out as slots with a token capacity each
    (the :class:`~shared.runner.kv.KVArena` contract the proposer's caches use)."""

    def __init__(self, lib: Any, ctx: Any, tokens: int, sequences: int) -> None:
        self._lib, self._memory = lib, lib.llama_get_memory(ctx)
        self.tokens = tokens
        self._free_seqs = list(range(sequences))
        self._slots: set[SeqSlot] = set()

    def allocate(self, tokens: int) -> SeqSlot | None:
        if tokens < 1:
            raise KVError(f"a slot needs at least one token, asked for {tokens}")
        if tokens > self.tokens:
            raise KVError(f"a session needing {tokens} tokens of KV cache can never fit: the llama.cpp context holds "
                          f"{self.tokens}. Raise --kv-cache-gb or ask for fewer tokens.")
        if not self._free_seqs or not self.fits(tokens):
            return None
        slot = SeqSlot(start=0, capacity=tokens, seq=self._free_seqs.pop(0), arena=self)
        self._lib.llama_memory_seq_rm(self._memory, slot.seq, -1, -1)
        self._slots.add(slot)
        return slot

    def free(self, slot: KVSlot) -> None:
        if not isinstance(slot, SeqSlot) or slot not in self._slots:
            return
        self._slots.remove(slot)
        self.forget(slot.seq, 0)
        bisect.insort(self._free_seqs, slot.seq)

    def share(self, src: KVSlot, dst: KVSlot, length: int) -> None:
        """``dst`` takes ``src``'s first ``length`` positions: its cells are tagged with ``dst`` too."""
        assert isinstance(src, SeqSlot) and isinstance(dst, SeqSlot)
        if not dst.length <= length <= min(src.length, dst.capacity):
            raise KVError(f"cannot share {length} rows: the source holds {src.length}, the destination "
                          f"{dst.length} of {dst.capacity}")
        self._lib.llama_memory_seq_cp(self._memory, src.seq, dst.seq, dst.length, length)
        dst.length = length

    def forget(self, seq: int, keep: int) -> None:
        """Drop the sequence's cells from position ``keep`` on."""
        if not self._lib.llama_memory_seq_rm(self._memory, seq, keep, -1):
            raise KVError(f"llama.cpp could not roll sequence {seq} back to {keep} tokens")

    @property
    def reserved_tokens(self) -> int:
        return sum(s.capacity for s in self._slots)

    @property
    def largest_free(self) -> int:
        return self.tokens - self.reserved_tokens if self._free_seqs else 0

    def fits(self, tokens: int) -> bool:
        return tokens <= self.largest_free

    @property
    def sessions(self) -> int:
        return len(self._slots)


class LlamaRunner:
    """One GGUF model in one llama.cpp context; not thread-safe (the drafter's worker calls it)."""

    def __init__(self, info: GgufInfo, kv_budget_bytes: int, threads: int = 0, sequences: int = 16) -> None:
        lib = self._lib = llama_cpp_module()
        self.info = info
        self.max_model_len = info.context_length
        self.threads = threads or len(os.sched_getaffinity(0))
        tokens = max(256, min(kv_budget_bytes // info.kv_bytes_per_token, 1 << 20)) // 256 * 256
        sequences = max(1, min(sequences, int(lib.llama_max_parallel_sequences())))
        self._model = lib.llama_model_load_from_file(str(info.path).encode(), lib.llama_model_default_params())
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {info.path} (its log above says why): is it a whole GGUF "
                                 "file of an architecture this llama.cpp build knows?")
        self._ctx = lib.llama_init_from_model(self._model, self._context_params(tokens, sequences))
        if not self._ctx:
            lib.llama_model_free(self._model)
            self._model = None
            raise ModelLoadError(f"llama.cpp could not make a context of {tokens} tokens for {info.name}: lower "
                                 "--kv-cache-gb or --max-sessions")
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
        if self.vocab_size != info.n_tokens:
            lib.llama_free(self._ctx)
            lib.llama_model_free(self._model)
            self._ctx = self._model = None
            raise ModelLoadError(f"{info.name}: llama.cpp reads {self.vocab_size} tokens, its metadata lists "
                                 f"{info.n_tokens}; the file is inconsistent")
        #: what one llama_decode takes (llama.cpp caps the asked batch at the context's size)
        self.batch_tokens = int(lib.llama_n_batch(self._ctx))
        self.kv = SeqArena(lib, self._ctx, int(lib.llama_n_ctx(self._ctx)), sequences)
        self.gpu = gpu_present(lib)
        self._batch = lib.llama_batch_init(self.batch_tokens, 0, 1)
        log.info("llama.cpp runner ready", model=info.name, file_type=info.file_type, kv_tokens=self.kv.tokens,
                 sequences=sequences, threads=self.threads, gpu=self.gpu,
                 kv_gib=round(self.kv.tokens * info.kv_bytes_per_token / 2**30, 3))

    def _context_params(self, tokens: int, sequences: int) -> Any:
        params = self._lib.llama_context_default_params()
        params.n_ctx = tokens
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        # rows with logits a decode may return: llama.cpp reserves at least one per sequence, and
        # aborts the process (an assertion) when that is above this
        params.n_outputs_max = max(min(BATCH_TOKENS, tokens), sequences)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True  # every sequence draws on the context's cells: a session uses what it fills
        params.no_perf = True
        return params

    def forward(self, segments: Sequence[Segment]) -> torch.Tensor | None:
        """Logits ``[rows, V]`` (float32) for the rows asked for, in segment order, or None when no
        segment wants any. Every fed token is then cached (the slots' lengths grow). A feed longer
        than one llama_decode takes goes in several, in order; if one fails, every segment's sequence
        is rolled back to where it was, and the error raised."""
        for seg in segments:
            if seg.slot.length + len(seg.tokens) > seg.slot.capacity:
                raise KVError(f"a step of {len(seg.tokens)} tokens overflows its slot ({seg.slot.length} of "
                              f"{seg.slot.capacity} held)")
        items = [(token, seg.slot.length + i, _seq(seg.slot), i >= seg.logits_from)
                 for seg in segments for i, token in enumerate(seg.tokens)]
        rows: list[torch.Tensor] = []
        try:
            for start in range(0, len(items), self.batch_tokens):
                if (out := self._decode(items[start : start + self.batch_tokens])) is not None:
                    rows.append(out)
        except Exception:
            for seg in segments:  # an earlier chunk's cells would break the sequence's positions from now on
                self.kv.forget(_seq(seg.slot), seg.slot.length)
            raise
        for seg in segments:
            seg.slot.length += len(seg.tokens)
        return torch.cat(rows) if rows else None

    def _decode(self, items: Sequence[tuple[int, int, int, bool]]) -> torch.Tensor | None:
        batch = self._batch
        batch.n_tokens = len(items)
        for i, (token, pos, seq, want) in enumerate(items):
            if not 0 <= token < self.vocab_size:
                raise KVError(f"token id {token} is outside the draft's vocabulary of {self.vocab_size}")
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, want
            batch.seq_id[i][0] = seq
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise KVError(f"llama_decode failed with {rc} ({'no KV cells left' if rc == 1 else 'see its log'})")
        rows = sum(1 for item in items if item[3])
        if not rows:
            return None
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits(self._ctx), shape=(rows, self.vocab_size))
        return torch.from_numpy(logits.copy())

    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        if getattr(self, "_ctx", None):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone already
            self.close()


def _seq(slot: KVSlot) -> int:
    if not isinstance(slot, SeqSlot):
        raise KVError("a llama.cpp runner drafts only in its own slots")
    return slot.seq


def load_llama(path: str, kv_budget_bytes: int, threads: int = 0, sequences: int = 16) -> LlamaRunner:
    """A GGUF file's runner (ModelLoadError, one line, when it cannot run here)."""
    return LlamaRunner(read_gguf(path), kv_budget_bytes, threads, sequences)
