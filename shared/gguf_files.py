"""GGUF files as drafts: what a file says about itself, without loading its weights.

A GGUF draft is run by llama.cpp (``shared.runner.llama``). Before a drafter joins a fleet it
must prove that its token ids are the target's, and it must know its own stop tokens and shape.
All of that is in the file's metadata, read here with the ``gguf`` package:

* the vocabulary: ``tokenizer.ggml.tokens`` (id -> token text) and the eos/bos ids. Its
  fingerprint is computed exactly as :func:`shared.models.tokenizer_fingerprint` computes a
  Hugging Face tokenizer's, so a GGUF made from the target's tokenizer matches the target;
* the shape that sizes the KV cache: layers, KV heads, head width, the context length.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ModelLoadError
from shared.vocabulary import Vocabulary

GGUF_MAGIC = b"GGUF"
KV_BYTES = 2  # llama.cpp keeps keys and values in float16 by default
PAD = re.compile(r"\[PAD\d+\]")
#: the metadata and tensor table sit at the front of the file: a 150k-token vocabulary takes ~4 MB
HEAD_BYTES = 32 << 20


@dataclass(frozen=True)
class GgufInfo:
    """What a drafter needs to know about a GGUF file before it loads the weights."""

    path: Path
    architecture: str
    vocabulary: Vocabulary  # of the tokens the tokenizer has (llama.cpp's converter pads the table)
    n_tokens: int  # rows of the embedding: the table with its padding
    eos_ids: frozenset[int]
    layers: int
    kv_heads: int
    head_dim: int
    context_length: int
    file_type: str  # e.g. Q4_1: the dominant tensor type of the file's matrices

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * KV_BYTES


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufHeader:
    """A GGUF file's header, key-value metadata and tensor table, parsed with ``struct`` (the
    ``gguf`` package's reader builds a numpy view per vocabulary entry: seconds for a 49k-token
    vocabulary, where this takes a few hundred milliseconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            self.data = f.read(HEAD_BYTES)
        self.at = 0
        if self._take("<4s") != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        version, tensors, keys = self._take("<I"), self._take("<Q"), self._take("<Q")
        if version < 2:
            raise ModelLoadError(f"{path} is GGUF version {version}; llama.cpp runs version 2 and later")
        self.fields = {self._string(): self._value() for _ in range(keys)}
        self.tensors = [self._tensor() for _ in range(tensors)]

    def _take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise EOFError(f"the metadata ends at byte {len(self.data)}")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        raw = self.data[self.at : self.at + n]
        if len(raw) < n:
            raise EOFError(f"a string runs past byte {len(self.data)}")
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int | None = None) -> Any:
        kind = self._take("<I") if kind is None else kind
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            inner, n = self._take("<I"), self._take("<Q")
            return [self._value(inner) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata type {kind}")
        return self._take(_SCALARS[kind])

    def _tensor(self) -> tuple[str, list[int], int, int]:
        name, dims = self._string(), self._take("<I")
        shape = [self._take("<Q") for _ in range(dims)]
        kind = self._take("<I")
        return name, shape, kind, self._take("<Q")  # the last: its offset in the data section

    @property
    def data_start(self) -> int:
        """Where the tensors' data section begins: after the tensor table, at the file's alignment."""
        align = int(self.fields.get("general.alignment", 32))
        return -(-self.at // align) * align

    def check_whole(self) -> None:
        """ModelLoadError unless every tensor's bytes are in the file (a download cut short is not)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        start = end = self.data_start
        for _, shape, kind, offset in self.tensors:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            elements = 1
            for dim in shape:
                elements *= dim
            end = max(end, start + offset + elements // block * size)
        if end > self.path.stat().st_size:
            raise ModelLoadError(f"{self.path} is truncated: its tensors need {end} bytes, the file has "
                                 f"{self.path.stat().st_size}; make or download it again")


def gguf_header(path: Path) -> GgufHeader:
    """A whole GGUF file's metadata and tensor table; ModelLoadError (one line: what to do) for a file
    that is missing, not GGUF, corrupt or cut short."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist: point --model (SPECFLEET_MODEL) at a .gguf file "
                             "(`specfleet fetch-model` makes the default target's copies)")
    try:
        header = GgufHeader(path)
        header.check_whole()
    except (ValueError, KeyError, OSError, EOFError, struct.error) as exc:
        raise ModelLoadError(f"{path} is truncated or corrupt ({type(exc).__name__}: {exc}); make or download it "
                             "again") from None
    return header


def _scalar(reader: GgufHeader, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key, default)
    if value is None:
        raise ModelLoadError(f"{reader.path} has no {key!r} in its metadata: it is not a model llama.cpp runs")
    return value


def _strings(reader: GgufHeader, key: str) -> list[str]:
    value = reader.fields.get(key)
    if not isinstance(value, list) or not value:
        raise ModelLoadError(f"{reader.path} carries no vocabulary ({key!r}): a draft must carry its tokenizer")
    return [str(v) for v in value]


def read_gguf(path: str | Path) -> GgufInfo:
    """The metadata of a GGUF file; ModelLoadError (one actionable line) when it is not usable.
    Read once per file version (a drafter reads it to join, then to load it)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return _read(path, 0, -1)  # missing: _read says so
    return _read(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _read(path: Path, mtime_ns: int, size: int) -> GgufInfo:
    reader = gguf_header(path)
    arch = str(_scalar(reader, "general.architecture"))
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    eos = _scalar(reader, "tokenizer.ggml.eos_token_id", -1)
    bos = _scalar(reader, "tokenizer.ggml.bos_token_id", -1)
    eot = _scalar(reader, "tokenizer.ggml.eot_token_id", -1)
    heads = int(_scalar(reader, f"{arch}.attention.head_count"))
    width = int(_scalar(reader, f"{arch}.embedding_length"))
    kv_heads = int(_scalar(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_scalar(reader, f"{arch}.attention.key_length", width // heads))
    vocabulary = Vocabulary.of([(t, i) for i, t in enumerate(_unpadded(tokens))],
                               eos if eos >= 0 else None, bos if bos >= 0 else None)
    return GgufInfo(path=path, architecture=arch, vocabulary=vocabulary, n_tokens=len(tokens),
                    eos_ids=frozenset(int(t) for t in (eos, eot) if t >= 0),
                    layers=int(_scalar(reader, f"{arch}.block_count")), kv_heads=kv_heads, head_dim=head_dim,
                    context_length=int(_scalar(reader, f"{arch}.context_length", 2048)),
                    file_type=_file_type(reader))


def _unpadded(tokens: list[str]) -> list[str]:
    """The table without the padding llama.cpp's converter appends up to the model's embedding rows
    (``[PAD151665]``, ...: a Qwen2 tokenizer has 151,665 tokens, its embedding 151,936 rows); a
    Hugging Face tokenizer's own table has no such entries."""
    end = len(tokens)
    while end > 0 and PAD.fullmatch(tokens[end - 1]):
        end -= 1
    return tokens[:end]


def _file_type(reader: GgufHeader) -> str:
    """The type most of the file's 2-D tensors are stored in (what its name usually says: Q4_1, ...)."""
    from gguf import GGMLQuantizationType

    counts: dict[int, int] = {}
    for _, shape, kind, _ in reader.tensors:
        if len(shape) == 2:
            counts[kind] = counts.get(kind, 0) + shape[0] * shape[1]
    if not counts:
        return "unknown"
    kind = max(counts, key=lambda k: counts[k])
    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def gguf_file(model: str | Path) -> Path | None:
    """``model`` as a GGUF file: the path itself when it ends in .gguf, or the one .gguf file in a
    directory (None when it names neither, e.g. a Hugging Face directory)."""
    path = Path(model)
    if path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ModelLoadError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                                 "name the one to run in --model")
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
