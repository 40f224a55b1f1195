"""A GGUF drafter joins a real verifier when its token ids are the target's, and is refused at the
handshake otherwise, with an error that names both vocabularies (never after drafting garbage)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from services.drafter.config import DrafterConfig
from services.drafter.link import LinkRefused
from services.drafter.main import serve as serve_drafter
from services.verifier.server import vocabulary_problem
from shared.config import from_flags
from shared.gguf_files import read_gguf
from shared.models import load_vocabulary
from shared.protocol import PROTOCOL_VERSION, Hello, Welcome
from shared.queue_memory import MemoryQueue
from tests.integration.test_verifier import TOKEN, serving

TIMEOUT_S = 60.0


def drafter(url: str, model: Path, proposer: str = "auto") -> DrafterConfig:
    return from_flags(DrafterConfig, model=str(model), verifier_url=f"{url}/v1/drafter", auth_token=TOKEN,
                      queue_url="memory://", node_id="gguf-drafter", torch_threads=1, proposer=proposer)


async def joins(url: str, cfg: DrafterConfig) -> None:
    joined = asyncio.Event()
    task = asyncio.create_task(serve_drafter(cfg, joined, queue=MemoryQueue()))
    try:
        await asyncio.wait_for(joined.wait(), TIMEOUT_S)  # the handshake passed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_a_gguf_of_the_targets_ids_joins_and_another_is_refused_naming_both(
        tiny_models: dict[str, Path], tiny_ggufs: dict[str, Path]) -> None:
    async with serving(tiny_models) as verifier:
        await joins(verifier.url, drafter(verifier.url, tiny_ggufs["target"]))
        with pytest.raises(LinkRefused) as info:
            await asyncio.wait_for(serve_drafter(drafter(verifier.url, tiny_ggufs["foreign"]), queue=MemoryQueue()),
                                   TIMEOUT_S)
    assert info.value.fatal and info.value.code == "bad_tokenizer"
    draft = read_gguf(tiny_ggufs["foreign"]).vocabulary.summary
    target = load_vocabulary(tiny_models["target"]).vocabulary
    assert target is not None
    assert draft in str(info.value) and target.summary in str(info.value)


@pytest.mark.asyncio
async def test_ngram_lookup_beside_a_gguf_copy_joins_on_the_ggufs_vocabulary(
        tiny_models: dict[str, Path], tiny_ggufs: dict[str, Path]) -> None:
    """A model-free proposer reads only the vocabulary of the GGUF named by --model (bench slo's fleets)."""
    async with serving(tiny_models) as verifier:
        await joins(verifier.url, drafter(verifier.url, tiny_ggufs["target"], "ngram"))


def welcome(fingerprint: str, ids: str) -> Welcome:
    return Welcome(node_id="v", protocol_version=PROTOCOL_VERSION, target_model="target",
                   tokenizer_fingerprint=fingerprint, max_model_len=64, max_draft_tokens=8, ids_fingerprint=ids,
                   vocabulary=f"10 tokens, ids {ids}")


def hello(fingerprint: str, ids: str = "") -> Hello:
    return Hello(role="drafter", node_id="d", protocol_version=PROTOCOL_VERSION, tokenizer_fingerprint=fingerprint,
                 ids_fingerprint=ids, vocabulary=f"12 tokens, ids {ids}" if ids else "", model="draft.gguf")


@pytest.mark.parametrize(("given", "joins"), [
    (hello("fp"), True),  # the same tokenizer
    (hello("other-fp", "ids"), True),  # the same token ids, other special tokens
    (hello("other-fp", "other-ids"), False),
    (hello("other-fp"), False),  # an older drafter that names only its fingerprint
])
def test_who_joins(given: Hello, joins: bool) -> None:
    problem = vocabulary_problem(given, welcome("fp", "ids"))
    assert (problem is None) == joins
    if problem is not None:
        assert "'draft.gguf'" in problem and "10 tokens, ids ids" in problem and "fetch-model" in problem
