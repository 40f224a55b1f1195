#!/bin/sh
# Shared install steps of the specfleet images (run by their Dockerfiles as root, cwd /opt/specfleet).
#   install.sh deps     a virtualenv in /opt/venv (seeing the base's own packages, e.g. a CUDA torch
#                       or vLLM) and the dependencies listed in pyproject.toml
#   install.sh project  specfleet itself (no dependencies: they are in the layer above)
#   install.sh llama-wheel  (a build stage) llama-cpp-python's wheel in /wheels: the one mounted at
#                       /prebuilt if any (the tests reuse the wheel `make install` built on the same
#                       machine), else built from its PyPI source with LLAMA_CMAKE_ARGS (needs a C++
#                       compiler: installed with apt-get where missing)
#   install.sh llama    install the wheel in /wheels (the build stage's, bind-mounted) into the virtualenv
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
llama-wheel)
    version=0.3.36
    mkdir -p /wheels
    if ls /prebuilt/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
        cp /prebuilt/llama_cpp_python-"$version"-*.whl /wheels/
        echo "llama.cpp: using the prebuilt wheel $(ls /wheels)"
        exit 0
    fi
    if ! command -v g++ >/dev/null; then
        apt-get update -q && apt-get install -y -q --no-install-recommends g++ make git >/dev/null
    fi
    # portable by default: any x86-64 CPU with AVX2, or any ARMv8.2 core with dot products (not the
    # builder's own CPU); no OpenMP runtime to carry, no multimodal library
    common="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
    common="$common -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    case "$(uname -m)" in
    x86_64) portable="$common -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
    aarch64) portable="$common -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" ;;
    *) portable="$common" ;;
    esac
    args="${LLAMA_CMAKE_ARGS:-$portable}"
    echo "llama.cpp: building llama-cpp-python $version from its PyPI source with: $args"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        python3 -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$version" -w /wheels
    ;;
llama)
    "$VENV/bin/pip" install --no-cache-dir /wheels/llama_cpp_python-*.whl
    # found, not imported: a CUDA build loads libcuda, which a build host (or qemu) may lack
    "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"
    ;;
*)
    echo "unknown mode $mode (deps|project|llama-wheel|llama)" >&2
    exit 2
    ;;
esac
