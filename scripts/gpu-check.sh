#!/usr/bin/env bash
# `make gpu-check`: does specfleet work on this GPU, and how fast? One command, under 8 minutes.
#
#   make gpu-check [DEVICE=cuda] [OUT=gpu-check-out] [BUDGET_S=420]
#   make gpu-check DEVICE=cpu     the dry run CI does: a small model stands in for the real shape
#
# 1. installs what the host lacks from wheelhouse/ (made by `make gpu-wheelhouse` on a machine
#    with registry access; the host needs none), without touching its torch or transformers;
# 2. runs `python -m bench gpu-check` (bench/gpu_check.py): the device unit tests, greedy identity
#    on the tiny models, and a Llama-3-8B-shaped target with oracle drafts at 1, 16 and 64 sessions;
# 3. leaves everything under $OUT (summary.md, results.json, logs) and prints the summary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-gpu-check-out}
BUDGET_S=${BUDGET_S:-420}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

needed="fastapi uvicorn websockets msgspec msgpack redis llguidance rich httpx prometheus_client tqdm gguf pytest
    pytest_asyncio pytest_timeout"
if ! "$PY" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" $needed 2>/dev/null; then
    if [ ! -f wheelhouse/requirements.txt ]; then
        echo "gpu-check: $PY lacks some of: $needed" >&2
        echo "and there is no wheelhouse/: run 'make gpu-wheelhouse' where a registry is reachable and copy" >&2
        echo "wheelhouse/ beside this checkout (README, 'The GPU check')." >&2
        exit 2
    fi
    echo "== installing the wheelhouse ($(ls wheelhouse/*.whl | wc -l) wheels) into $($PY -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links wheelhouse \
        -r wheelhouse/requirements.txt
fi

if [ "$DEVICE" = cpu ]; then  # the dry run: the same steps, small enough for CI
    flags=(--shape small --sessions 1,4 --alphas 0.8 --max-tokens 16 --unit-args "-k test_prefill_in_chunks")
else
    flags=(--shape llama3-8b --sessions 1,16,64 --alphas 0.6,0.8 --max-tokens 64)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== python -m bench gpu-check --device $DEVICE (at most $BUDGET_S s; output in $OUT)"
timeout --kill-after 20 $((BUDGET_S + 40)) "$PY" -m bench gpu-check --device "$DEVICE" --out "$OUT" \
    --budget-s "$BUDGET_S" "${flags[@]}"
