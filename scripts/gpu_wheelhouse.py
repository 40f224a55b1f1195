"""``make gpu-wheelhouse``: the wheels a GPU host without a registry needs to run the GPU check.

The GPU host has Python 3.12 with torch (CUDA) and transformers already installed. This downloads,
on a machine with registry access, every other runtime dependency of specfleet and the test
runner for CPython 3.12 on x86-64 Linux, each pinned to the version installed in this machine's
venv when it has one (what the tests here ran against), into ``wheelhouse/`` (git-ignored), with
a ``requirements.txt`` that ``scripts/gpu-check.sh`` installs from, offline.

    python scripts/gpu_wheelhouse.py [--out wheelhouse] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what the GPU image brings (torch and transformers, and what transformers itself requires)
ON_THE_HOST = {"torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy", "packaging",
               "pyyaml", "regex", "filelock", "fsspec", "requests", "tqdm", "accelerate", "typing-extensions"}
#: only for importing GGUF files, which the check does not do
NOT_NEEDED = {"accelerate"}
TEST_TOOLS = ["pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3"]
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{v}_x86_64" for v in (17, 24, 27, 28, 31, 34, 35)),
             "linux_x86_64"]
#: the checkout plus the wheelhouse must fit the GPU host's 64 MiB allowance; the checkout is ~42 MiB
MOST_MIB = 20.0


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def wanted() -> list[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if _name(d) not in ON_THE_HOST | NOT_NEEDED] + TEST_TOOLS


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def resolve(requirements: list[str], python: str) -> dict[str, str]:
    """``{name: version}`` of everything they need on the target Python, less what the host has."""
    platform_flags = [f for p in PLATFORMS for f in ("--platform", p)]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        _pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report), "--target",
             str(Path(tmp) / "t"), "--python-version", python, "--implementation", "cp", "--only-binary=:all:",
             *platform_flags, *requirements)
        rows = json.loads(report.read_text())["install"]
    found = {_name(r["metadata"]["name"]): r["metadata"]["version"] for r in rows}
    return {name: _local_version(name) or version for name, version in sorted(found.items())
            if name not in ON_THE_HOST}


def _local_version(name: str) -> str | None:
    """The version this machine's venv has (the one the tests ran against), if any."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def download(pins: dict[str, str], out: Path, python: str) -> None:
    platform_flags = [f for p in PLATFORMS for f in ("--platform", p)]
    out.mkdir(parents=True, exist_ok=True)
    _pip("download", "--quiet", "--no-deps", "--dest", str(out), "--python-version", python, "--implementation",
         "cp", "--only-binary=:all:", *platform_flags, *(f"{n}=={v}" for n, v in pins.items()))
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_wheelhouse.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    p.add_argument("--python-version", default="3.12", help="the GPU host's Python (default 3.12)")
    args = p.parse_args(argv)
    for old in args.out.glob("*.whl"):
        old.unlink()
    pins = resolve(wanted(), args.python_version)
    print(f"downloading {len(pins)} wheels for CPython {args.python_version} on x86-64 Linux into {args.out}")
    download(pins, args.out, args.python_version)
    size = sum(f.stat().st_size for f in args.out.glob("*.whl")) / 2**20
    print(f"wheelhouse: {len(list(args.out.glob('*.whl')))} wheels, {size:.1f} MiB (limit {MOST_MIB:.0f} MiB)")
    if size > MOST_MIB:
        print(f"the wheelhouse is over {MOST_MIB:.0f} MiB: the checkout and it would not fit the GPU host",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
