"""A GGUF file as the draft: the target's own weights in a few bits, run by specfleet's 4-bit kernel or llama.cpp.

This is the edge drafter that pays without training: a 4-bit copy of the target agrees with it
on almost every token, at a fraction of its step (``docs/models.md``; ML-SpecQD drafts the same
way on CPUs). Any GGUF file whose token ids are the target's can draft.

The proposer is the draft-model proposer (``draft_model.py``) over the file's runner: specfleet's lean
runner with every matrix in 4-bit blocks (by default a Q4_1 file's own, or a Q8_0 file's cut to 4 bits:
on a CPU 2 to 2.5 times llama.cpp's speed), or llama.cpp (``shared.runner.llama``) for other files and
GPUs; the choice is
``--gguf-backend`` (``shared.runner.gguf_backend``). It keeps the draft-model proposer's whole contract
(described here for llama.cpp; the specfleet backend is the draft-model proposer's own runner):

* one llama.cpp context drafts for every session in one batch, one sequence per session
  (StarSD §3): each draft position of the batch is one ``llama_decode``;
* a commit rolls each sequence back past the rejected drafts (``llama_memory_seq_rm``);
* a sampled draft carries the exact q it was drawn from, and a raced request drafts the winner
  of the verifier's keyed race, from llama.cpp's logits;
* lookahead branches could draft in spare sequences that share the main one's cells
  (``llama_memory_seq_cp``: a tag, not a copy), and a greedy draft names each token's runner-up.
  On a CPU this proposer declines the branches (:attr:`GgufProposer.branches_pay`): llama.cpp's
  quantized matmuls are compute-bound there, each branch's row costs a whole row, and the draft,
  not the verifier, is the bottleneck. Measured with the Q4_1 copy at 1 request, k = 8, the verifier
  on CPU 0 and the drafter on CPU 1 (``python -m bench profile``, 2026-12-01): 34.5 tokens/s with
  one branch (the drafter's CPU 96 % busy), 48.4 without. With llama.cpp on a GPU (a Jetson's CUDA
  build) extra rows are nearly free and the branches are drafted;
* the controllers' step features, penalties, resuming another drafter's session (its first
  draft prefills the committed sequence), all as the draft-model proposer does.

Its vocabulary comes from the file's metadata (``shared.gguf_files``): the drafter sends its
fingerprint in Hello, and a verifier whose target has other token ids refuses it there.
"""

from __future__ import annotations

from services.drafter.proposers.draft_model import DraftModelProposer
from shared.draft_q import Nucleus
from shared.gguf_files import GgufInfo
from shared.models import LoadedModel
from shared.runner.llama import LlamaRunner
from shared.runner.step import SegmentRunner


def gguf_draft(info: GgufInfo) -> LoadedModel:
    """What the drafter announces of a GGUF draft (``shared.gguf_files.read_gguf``; no weights
    loaded yet): its vocabulary, stop tokens and limits."""
    return LoadedModel(model=None, tokenizer=None, name=info.name, path=str(info.path.resolve()),
                       fingerprint=info.vocabulary.fingerprint, eos_ids=set(info.eos_ids),
                       max_model_len=info.context_length, vocab_size=info.n_tokens,
                       vocabulary=info.vocabulary)


class GgufProposer(DraftModelProposer):
    """Drafts with a GGUF file, on its backend (``shared.runner.gguf_backend``: specfleet's 4-bit kernel
    or llama.cpp). Not thread-safe: the serving loop calls it from one worker."""

    name = "gguf"

    def __init__(self, runner: SegmentRunner, info: GgufInfo, mode: str = "sampled", nucleus: Nucleus | None = None,
                 share_prefixes: bool = True, lookup_rows: int = 0) -> None:
        super().__init__(runner, info.eos_ids, mode, nucleus, share_prefixes, lookup_rows)
        self.info = info
        self.backend = "llama.cpp" if isinstance(runner, LlamaRunner) else "specfleet"
        #: lookahead branches pay only where an extra row of a forward is nearly free: llama.cpp on a GPU,
        #: or specfleet's 4-bit kernel (4 rows cost 1.5 times 1 row's step: its integer products are cheap)
        self.branches_pay = runner.gpu if isinstance(runner, LlamaRunner) else True
        if not self.branches_pay:  # so do looked-up rows
            self.lookup_rows = 0

    def close_model(self) -> None:
        """Free llama.cpp's context and weights (the drafter's shutdown); the specfleet backend's go with it."""
        if isinstance(self.runner, LlamaRunner):
            self.runner.close()
