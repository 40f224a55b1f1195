#!/usr/bin/env bash
# `make test`: every test tier, then the smoke run and lint, within CI's time on its two cores.
#
# The unit and statistical tiers come first (tests/conftest.py orders them) and the unit tier
# uses one core, so lint and the smoke run go beside them on the other; the tiers that start
# services and time faults run after. Each part's output is
# printed, and the run fails if any part failed.
#
#   scripts/test.sh VENV_BIN [pytest flags ...]
set -uo pipefail
bin=${1:?usage: scripts/test.sh VENV_BIN [pytest flags ...]}
shift
# podman's and buildah's settings, images and networks live in .specfleet/podman (nothing under
# /etc or /var/lib changes; the Makefile sets this up already)
[ -n "${CONTAINERS_STORAGE_CONF:-}" ] || eval "$(bash deploy/podman/configure.sh)"
# and the caches the tiers fill (vLLM's compiled kernels, matplotlib's fonts, chromium's) go there too
export XDG_CACHE_HOME="$PWD/.specfleet/cache"
mkdir -p .specfleet/logs
side_log=.specfleet/logs/test-lint-and-smoke.log
(
    set -e
    echo "== lint (ruff, mypy)"
    "$bin/ruff" check .
    "$bin/mypy" shared services training bench
    echo "== smoke run (make smoke)"
    make --no-print-directory smoke
) >"$side_log" 2>&1 &
side=$!
# The k8s tier's local base image (debootstrap: mostly downloads) and its three images are made
# beside them too, in the time lint and the smoke run leave free: the tier's own build then finds
# every layer cached (if this build is still running then, both build at once: slower, never wrong).
# The tier reports any failure itself.
base=""
if command -v podman >/dev/null && command -v debootstrap >/dev/null && [ "$(id -u)" -eq 0 ]; then
    (bash deploy/images/local-base.sh && "$bin/python" deploy/k8s/podman_play.py build) \
        >.specfleet/logs/test-k8s-images.log 2>&1 &
    base=$!
fi
# Ctrl-C (or CI's cancel) stops what runs beside the tests too.
trap 'kill $side $base 2>/dev/null; exit 130' INT TERM
"$bin/pytest" -q -m "not slow" --durations=25 "$@"
tests_rc=$?
wait "$side"
side_rc=$?
[ -z "$base" ] || wait "$base" || true
cat "$side_log"
if [ "$side_rc" -ne 0 ]; then
    echo "make test: lint or the smoke run failed (exit $side_rc); its output is above and in $side_log" >&2
fi
if [ "$tests_rc" -ne 0 ]; then
    echo "make test: pytest failed (exit $tests_rc)" >&2
    exit "$tests_rc"
fi
exit "$side_rc"
