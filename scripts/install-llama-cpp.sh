#!/usr/bin/env bash
# `make install`'s llama.cpp step: llama-cpp-python (the runtime of the GGUF edge drafts) built once
# from its source distribution on PyPI, into a wheel under .specfleet/wheels, then installed.
#
#   scripts/install-llama-cpp.sh start VENV_BIN    start the build in the background (beside the venv's
#                                                  own install, which mostly downloads; pip wheel changes
#                                                  nothing in the venv)
#   scripts/install-llama-cpp.sh install VENV_BIN [force]  wait for that build (or build now), install the
#                                                  wheel (force: even over an installed llama-cpp-python)
#
# Nothing is downloaded from anywhere but the package index. A machine where it does not build
# (no C++ compiler, an unusual CPU) keeps going: `make run` then serves with the distilled drafts and
# says so in one line. The build's output is in .specfleet/logs/llama-cpp-build.log.
# LLAMA_CMAKE_ARGS overrides the CMake flags (default: this machine's CPU, no multimodal library,
# no OpenMP runtime to carry); the images' flags are in deploy/images/README.md. Where the CPU lists AMX
# but faults on its instructions (some virtual machines: llama.cpp's native build then dies of SIGILL
# at its first matrix product), llama.cpp is built without AMX, and an AMX build already here is redone.
set -uo pipefail
usage="usage: scripts/install-llama-cpp.sh start VENV_BIN | install VENV_BIN [force]"
mode=${1:?$usage}
bin=${2:?$usage}
version=0.3.36
wheels=.specfleet/wheels
log=.specfleet/logs/llama-cpp-build.log
lock=$wheels/.build.lock
mkdir -p "$wheels" .specfleet/logs
flags="-DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
flags="$flags -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"

# amx_faults: true where /proc/cpuinfo lists AMX and a probe's one AMX instruction does not run
amx_faults() {
    grep -qw amx_tile /proc/cpuinfo 2>/dev/null || return 1
    local dir rc
    dir=$(mktemp -d)
    cat >"$dir/amx.c" <<'C'
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64] = {1};  /* palette 1, tile 0: 16 rows of 64 bytes */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 1;
    cfg[16] = 64; cfg[48] = 16;
    _tile_loadconfig(cfg); _tile_zero(0); _tile_release();
    return 0;
}
C
    if ! "${CC:-cc}" -O1 -mamx-tile "$dir/amx.c" -o "$dir/amx" 2>/dev/null; then rm -rf "$dir"; return 1; fi
    { "$dir/amx"; } >/dev/null 2>&1
    rc=$?
    rm -rf "$dir"
    [ "$rc" -ne 0 ]
}
noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# stale_amx: the installed llama.cpp was built with AMX on a machine where AMX faults
stale_amx() {
    "$bin/python" -c "import llama_cpp, sys; sys.exit('AMX_INT8 = 1' not in llama_cpp.llama_print_system_info().decode())" \
        2>/dev/null && amx_faults
}

have_wheel() { ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; }
installed() { "$bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; }

# build PYTHON: the wheel, under the lock; its outcome in $wheels/.build.status ("ok SECONDS" or "failed")
build() {
    local started
    started=$(date +%s)
    local cflags="${CFLAGS:-}" cxxflags="${CXXFLAGS:-}"
    : >"$log"
    if amx_faults; then
        echo "this CPU lists AMX but faults on its instructions (a virtual machine's limit): building without AMX" \
            >>"$log"
        cflags="$cflags $noamx" cxxflags="$cxxflags $noamx"
    fi
    if CFLAGS="$cflags" CXXFLAGS="$cxxflags" CMAKE_ARGS="${LLAMA_CMAKE_ARGS:-$flags}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$1" -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" \
        -w "$wheels" >>"$log" 2>&1; then
        echo "ok $(( $(date +%s) - started ))" >"$wheels/.build.status"
    else
        echo failed >"$wheels/.build.status"
    fi
}

case "$mode" in
start)
    { installed || have_wheel; } && exit 0
    echo "make install: building llama.cpp (llama-cpp-python $version) from its source on PyPI for the GGUF edge"
    echo "  drafts, beside the rest of the install: about 5 minutes on 2 cores, once (log: $log)"
    rm -f "$wheels/.build.status"
    # the lock is taken before this returns, so `install` waits for this build
    flock -n "$lock" true || exit 0  # a build is already running
    (flock "$lock" bash -c "$(declare -f build amx_faults); noamx='$noamx' wheels='$wheels' log='$log' version='$version' flags='$flags' \
        build '$bin/python'" </dev/null >/dev/null 2>&1 &)
    sleep 1
    ;;
install)
    if installed && stale_amx; then
        echo "make install: the installed llama.cpp was built with AMX, which this CPU lists but faults on: building it"
        echo "  again without AMX (about 5 minutes on 2 cores)"
        rm -f "$wheels"/llama_cpp_python-*.whl "$wheels/.build.status"
    elif [ "${3:-}" != force ] && installed; then
        exit 0
    fi
    if ! have_wheel; then
        flock "$lock" true  # wait for a build started beside the install
        if ! have_wheel && [ ! -f "$wheels/.build.status" ]; then
            echo "make install: building llama.cpp (llama-cpp-python $version) from its source on PyPI for the GGUF"
            echo "  edge drafts: about 5 minutes on 2 cores, once (log: $log)"
            flock "$lock" bash -c "$(declare -f build amx_faults); noamx='$noamx' wheels='$wheels' log='$log' version='$version' \
                flags='$flags' build '$bin/python'"
        fi
    fi
    if ! have_wheel; then
        echo "make install: llama.cpp did not build here (the end of $log says why); make run serves with the" >&2
        echo "  distilled drafts instead of the target's GGUF copies. Retry with: make install-llama" >&2
        exit 0
    fi
    read -r _ seconds 2>/dev/null <"$wheels/.build.status" && [ -n "${seconds:-}" ] && \
        echo "make install: llama.cpp built in $seconds s"
    head -1 "$log" 2>/dev/null | grep -q "lists AMX" && echo "make install: $(head -1 "$log")"
    rm -f "$wheels/.build.status"
    # with its dependencies (diskcache, jinja2, ...: llama_cpp does not import without them); an older
    # llama-cpp-python goes first so that pip installs this wheel and leaves torch's numpy alone
    "$bin/python" -m pip uninstall -y -q llama-cpp-python >>"$log" 2>&1
    if ! "$bin/python" -m pip install -q "$(ls "$wheels"/llama_cpp_python-"$version"-*.whl | head -1)" \
        >>"$log" 2>&1 || ! installed; then
        echo "make install: the llama.cpp wheel did not install (the end of $log says why); make run serves with" \
            "the distilled drafts" >&2
    elif [ -z "${AMX_REBUILT:-}" ] && stale_amx; then  # a wheel cached from before the probe
        echo "make install: the cached llama.cpp wheel uses AMX, which this CPU lists but faults on: building it again"
        rm -f "$wheels"/llama_cpp_python-*.whl
        AMX_REBUILT=1 exec bash "$0" install "$bin" force
    fi
    ;;
*)
    echo "unknown mode $mode (start|install)" >&2
    exit 2
    ;;
esac
