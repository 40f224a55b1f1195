"""Verifier backend on plain PyTorch + transformers, with a per-session KV cache.

Each session owns its key/value tensors (``[1, kv_heads, L, head_dim]`` per layer). A batched
``score`` call left-pads the sessions' caches to a common length, right-pads their new tokens,
and runs ONE forward pass with an attention mask and explicit position ids, so sessions of
different context and draft lengths share the pass. The new tokens' keys/values are held as
"pending" until ``commit`` says how many to keep; rejected drafts are simply never appended.

This is the reference backend (CPU or one CUDA GPU). It copies the caches into the padded
batch each step, which is cheap next to the forward pass at small scale; the vLLM backend with
paged attention is the production path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from services.verifier.backends.base import BackendError, KVStats, ScoreItem
from shared.models import LoadedModel

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), [1, H, L, D]


@dataclass
class _SessionKV:
    layers: KV
    length: int
    pending: KV | None = None  # keys/values of the tokens fed by the last score()
    pending_len: int = 0
    pending_ids: list[int] = field(default_factory=list)


class TorchBackend:
    """Runs a transformers causal LM. Not thread-safe: the engine calls it from one task."""

    def __init__(self, loaded: LoadedModel, pad_id: int = 0) -> None:
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        self.pad_id = pad_id
        self._sessions: dict[str, _SessionKV] = {}

    # --- lifecycle -----------------------------------------------------------------------

    def open(self, session_id: str, prompt_ids: list[int]) -> None:
        if session_id in self._sessions:
            raise BackendError(f"session {session_id} is already open")
        self._sessions[session_id] = self._empty_kv()
        if len(prompt_ids) > 1:
            self.score([ScoreItem(session_id, prompt_ids[:-1])])
            self.commit(session_id, len(prompt_ids) - 1)

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def kv_stats(self) -> KVStats:
        tokens = sum(s.length for s in self._sessions.values())
        nbytes = sum(k.numel() * k.element_size() * 2 for s in self._sessions.values() for k, _ in s.layers)
        return KVStats(sessions=len(self._sessions), cached_tokens=tokens, bytes=nbytes)

    # --- the batched pass ----------------------------------------------------------------

    @torch.inference_mode()
    def score(self, items: list[ScoreItem]) -> list[torch.Tensor]:
        if not items:
            return []
        kvs = [self._get(item.session_id) for item in items]
        past_max = max(kv.length for kv in kvs)
        new_max = max(len(item.input_ids) for item in items)
        for item, kv in zip(items, kvs, strict=True):
            if kv.length + len(item.input_ids) > self.max_model_len:
                raise BackendError(f"session {item.session_id} would pass the {self.max_model_len}-token context")
        input_ids = torch.full((len(items), new_max), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), past_max + new_max), dtype=torch.long)
        positions = torch.zeros((len(items), new_max), dtype=torch.long)
        for row, (item, kv) in enumerate(zip(items, kvs, strict=True)):
            n = len(item.input_ids)
            input_ids[row, :n] = torch.tensor(item.input_ids)
            mask[row, past_max - kv.length : past_max + n] = 1
            positions[row] = kv.length + torch.arange(new_max)
        cache = self._padded_cache(kvs, past_max)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits.float()
        results = []
        for row, (item, kv) in enumerate(zip(items, kvs, strict=True)):
            n = len(item.input_ids)
            new = slice(past_max, past_max + n)
            kv.pending = [
                (layer.keys[row : row + 1, :, new], layer.values[row : row + 1, :, new])
                for layer in out.past_key_values.layers
            ]
            kv.pending_len, kv.pending_ids = n, list(item.input_ids)
            results.append(logits[row, :n].cpu())
        return results

    def commit(self, session_id: str, keep: int) -> None:
        kv = self._get(session_id)
        if kv.pending is None or not 0 <= keep <= kv.pending_len:
            raise BackendError(f"session {session_id}: cannot keep {keep} of {kv.pending_len} pending tokens")
        kv.layers = [
            (torch.cat([k, pk[:, :, :keep]], dim=2), torch.cat([v, pv[:, :, :keep]], dim=2))
            for (k, v), (pk, pv) in zip(kv.layers, kv.pending, strict=True)
        ]
        kv.length += keep
        kv.pending, kv.pending_len, kv.pending_ids = None, 0, []

    # --- helpers -------------------------------------------------------------------------

    def _get(self, session_id: str) -> _SessionKV:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise BackendError(f"unknown session {session_id}") from None

    def _empty_kv(self) -> _SessionKV:
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        empty = torch.zeros((1, heads, 0, head_dim), dtype=dtype, device=self.device)
        return _SessionKV(layers=[(empty, empty) for _ in range(cfg.num_hidden_layers)], length=0)

    def _padded_cache(self, kvs: list[_SessionKV], past_max: int) -> DynamicCache:
        """Stack the sessions' caches, left-padded with zeros to ``past_max`` positions."""
        if past_max == 0:
            return DynamicCache()
        layers = []
        for layer in range(len(kvs[0].layers)):
            keys, values = [], []
            for kv in kvs:
                k, v = kv.layers[layer]
                pad = past_max - kv.length
                if pad:
                    k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                    v = torch.nn.functional.pad(v, (0, 0, pad, 0))
                keys.append(k)
                values.append(v)
            layers.append((torch.cat(keys), torch.cat(values)))
        return DynamicCache(ddp_cache_data=layers)
