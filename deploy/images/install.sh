#!/bin/sh
# Shared install steps of the specfleet images (run by their Dockerfiles as root, cwd /opt/specfleet).
#   install.sh deps     a virtualenv in /opt/venv (seeing the base's own packages, e.g. a CUDA torch
#                       or vLLM) and the dependencies listed in pyproject.toml
#   install.sh project  specfleet itself (no dependencies: they are in the layer above)
# Environment (Dockerfile ARGs): KEEP_BASE_TORCH=1 keeps the base image's torch instead of the
# pinned one (L4T, vLLM); TORCH_INDEX adds an index for torch (the CPU wheels by default; empty:
# none); PROJECT_PIP_FLAGS extra flags for the project install; PIP_* configure pip as usual.
set -eu
mode="${1:?usage: install.sh deps|project}"
VENV=/opt/venv

case "$mode" in
deps)
    # specfleet needs Python >= 3.11 (asyncio.timeout, tomllib); stop here, not at run time.
    if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "this base image has Python $(python3 -V 2>&1); specfleet needs 3.11 or newer:" >&2
        echo "choose a BASE_IMAGE with Python >= 3.11 (deploy/images/README.md)" >&2
        exit 1
    fi
    python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" - <<'PY' >/tmp/requirements.txt
import os, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
keep_base_torch = os.environ.get("KEEP_BASE_TORCH", "0") == "1"
print("\n".join(d for d in deps if not (keep_base_torch and d.replace(" ", "").startswith("torch="))))
PY
    if [ "${KEEP_BASE_TORCH:-0}" = 1 ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        echo "KEEP_BASE_TORCH=1 but the base image has no importable torch" >&2
        exit 1
    fi
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /tmp/requirements.txt
    # PyPI's torchvision breaks transformers' imports beside a CPU torch; specfleet never uses it.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    rm -f /tmp/requirements.txt
    ;;
project)
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --no-cache-dir --no-deps --no-build-isolation ${PROJECT_PIP_FLAGS:-} .
    "$VENV/bin/specfleet" --help >/dev/null
    rm -rf build ./*.egg-info
    ;;
*)
    echo "unknown mode $mode (deps|project)" >&2
    exit 2
    ;;
esac
