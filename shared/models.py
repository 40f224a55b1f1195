"""Model loading from a local Hugging Face directory, tokenizer fingerprints, tiny test models.

specfleet never reaches for a model hub: every path must be a local directory holding a
``config.json``, weights and tokenizer files. ``make_tiny_family`` builds a throwaway target
and draft (random-initialised Llama-style, sharing one tokenizer) for tests and the default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub, even by accident
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch

from shared.errors import ModelLoadError as ModelLoadError  # its home before shared.errors; imported from here too
from shared.vocabulary import Vocabulary as Vocabulary

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM); None for a vocabulary alone or a GGUF draft
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    name: str
    path: str
    fingerprint: str
    eos_ids: set[int] = field(default_factory=set)
    max_model_len: int = 2048
    vocab_size: int = 0
    vocabulary: Vocabulary | None = None


def tokenizer_vocabulary(tokenizer: Any) -> Vocabulary:
    """A Hugging Face tokenizer's :class:`Vocabulary`: its whole table (added tokens too)."""
    table = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return Vocabulary.of(table, tokenizer.eos_token_id, tokenizer.bos_token_id)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what makes two tokenizers interchangeable: the vocabulary and eos/bos ids."""
    return tokenizer_vocabulary(tokenizer).fingerprint


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line; [] where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="ignore")
        except OSError:
            return []
    return next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX): then a bfloat16 model is
    memory-bound like a GPU at small batch. Elsewhere bfloat16 matmuls are emulated and slow."""
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str, stored: str = "") -> torch.dtype:
    """``auto``: a checkpoint stored in float32 (``stored``, its config's dtype: the tiny test models)
    runs in float32, as its reference does; any other in bfloat16 on CUDA and on CPUs with native
    bfloat16, and in float32 on other CPUs."""
    if name == "auto":
        if stored == "float32":
            return torch.float32
        if device != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; use auto, float32, float16 or bfloat16") from None


def stored_dtype(path: Path) -> str:
    """The dtype a model directory's config says its weights are stored in ("" when it says none)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("dtype") or config.get("torch_dtype") or "")


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    _check_dir(Path(path))
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from None


def load_model(
    path: str | Path, device: str = "cpu", dtype: str = "auto", max_model_len: int = 0
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    import shared.factorised  # noqa: F401  (registers the draft models' type with transformers)

    path = Path(path)
    tokenizer = load_tokenizer(path)
    vocabulary = tokenizer_vocabulary(tokenizer)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, dtype=resolve_dtype(dtype, device, stored_dtype(path))
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {exc}") from None
    model.eval().to(device)
    eos = _eos_ids(getattr(model, "generation_config", None), tokenizer)
    limit = int(getattr(model.config, "max_position_embeddings", 2048))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=path.name,
        path=str(path.resolve()),
        fingerprint=vocabulary.fingerprint,
        eos_ids=eos,
        max_model_len=min(limit, max_model_len) if max_model_len > 0 else limit,
        vocab_size=int(model.config.vocab_size),
        vocabulary=vocabulary,
    )


def load_vocabulary(path: str | Path) -> LoadedModel:
    """A model directory's tokenizer alone, no weights: what a model-free drafter needs to join
    a fleet (the verifier checks the tokenizer fingerprint)."""
    path = Path(path)
    tokenizer = load_tokenizer(path)
    vocabulary = tokenizer_vocabulary(tokenizer)
    return LoadedModel(model=None, tokenizer=tokenizer, name=path.name, path=str(path.resolve()),
                       fingerprint=vocabulary.fingerprint, eos_ids=_eos_ids(None, tokenizer),
                       vocab_size=len(tokenizer), vocabulary=vocabulary)


def load_target_info(path: str | Path, max_model_len: int = 0) -> LoadedModel:
    """Everything about a target but its weights (tokenizer, stop ids, limits), for a verifier
    whose weights another engine (vLLM) loads."""
    from transformers import AutoConfig, GenerationConfig

    import shared.factorised  # noqa: F401  (registers the draft models' type with transformers)

    info = load_vocabulary(path)
    try:
        config = AutoConfig.from_pretrained(info.path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {exc}") from None
    try:
        generation = GenerationConfig.from_pretrained(info.path, local_files_only=True)
    except OSError:
        generation = None
    info.eos_ids = _eos_ids(generation, info.tokenizer)
    limit = int(getattr(config, "max_position_embeddings", 2048))
    info.max_model_len = min(limit, max_model_len) if max_model_len > 0 else limit
    info.vocab_size = int(config.vocab_size)
    return info


def _check_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {path} does not exist. Point the --model flag (or SPECFLEET_MODEL) at a "
            "local Hugging Face model directory, or run `specfleet make-tiny-models` to create test models."
        )
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json; it is not a Hugging Face model directory")


def _eos_ids(generation_config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, list):
        ids.update(int(i) for i in gen_eos)
    return ids


# --- tiny models the project makes itself ---------------------------------------------------


def _corpus_lines(limit_bytes: int) -> list[str]:
    """Python standard-library source: present on every machine that runs specfleet."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        lines.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return lines


def train_bpe(texts: Iterable[str], out_dir: Path, vocab_size: int, show_progress: bool = False) -> Any:
    """Fit a byte-level BPE (any text round-trips) with specfleet's special tokens and chat
    template, and save it as a Hugging Face tokenizer in out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>", clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def make_tokenizer(out_dir: Path, vocab_size: int = 320) -> Any:
    """The tiny test models' BPE, fitted on stdlib source."""
    return train_bpe(_corpus_lines(400_000), out_dir, vocab_size)


@dataclass(frozen=True)
class TinySpec:
    layers: int = 4
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 1
    intermediate: int = 128
    max_positions: int = 512
    init_std: float = 0.2  # large enough that greedy argmax is never a near-tie
    #: std of each layer's output projections: small, so shallower drafts agree with the target
    #: often (measured: 1 of 4 layers ~0.5 greedy agreement, 2 of 4 ~0.6)
    layer_out_std: float = 0.002


def make_tiny_family(out_dir: str | Path, seed: int = 0, vocab_size: int = 320, spec: TinySpec = TinySpec(),
                     draft_layers: tuple[int, ...] = (1, 2)) -> dict[str, Path]:
    """Create ``target`` and ``draft-L{n}`` models under out_dir (idempotent).

    Drafts copy the target's embeddings, head and first n layers, so they agree with it often
    but not always: enough to exercise partial acceptance in tests.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    paths = {"target": out / "target", **{f"draft-L{n}": out / f"draft-L{n}" for n in draft_layers}}
    if all((p / "config.json").exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(paths["target"], vocab_size)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, initializer_range=spec.init_std,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.normal_(0.0, spec.layer_out_std)
    target.save_pretrained(str(paths["target"]))
    for n in draft_layers:
        dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": n})
        draft = LlamaForCausalLM(dcfg).eval()
        state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.")
                 or int(k.split(".")[2]) < n}
        draft.load_state_dict(state)
        draft.save_pretrained(str(paths[f"draft-L{n}"]))
        tokenizer.save_pretrained(str(paths[f"draft-L{n}"]))
    return paths
