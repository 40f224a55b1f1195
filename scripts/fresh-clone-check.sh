#!/usr/bin/env bash
# Does `make run` work from a clean clone on a fresh Debian, with nothing installed by hand?
# Clones HEAD, starts a bookworm container (podman, host network), installs only what Debian
# lacks of the README's prerequisites (python3.11-venv, make, g++, git, curl), runs `make run` and
# sends the README's first request. Prints the reply; exits non-zero if there is none.
#
#   scripts/fresh-clone-check.sh [IMAGE]   (default: docker.io/library/debian:bookworm, or the k8s tier's
#                                           localhost/specfleet-base:bookworm where no registry is reachable)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
IMAGE=${1:-docker.io/library/debian:bookworm}
[ -n "${CONTAINERS_STORAGE_CONF:-}" ] || eval "$(bash deploy/podman/configure.sh)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q . "$work/specfleet"
echo "== clean clone of $(git rev-parse --short HEAD) in $IMAGE"
# where this host reaches its registries through a TLS proxy, the container trusts the same CA
cert=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    cert=(-v "$PIP_CERT:/etc/host-ca.pem:ro" -e PIP_CERT=/etc/host-ca.pem)
    echo "== the container trusts this host's CA bundle $PIP_CERT (PIP_CERT)"
fi
podman run --rm --network host -v "$work/specfleet:/src" -w /src -e PIP_EXTRA_INDEX_URL "${cert[@]}" "$IMAGE" bash -euc '
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv make g++ git curl ca-certificates \
        procps >/dev/null
    started=$(date +%s)
    (make run >/tmp/run.log 2>&1 &)
    for _ in $(seq 1 900); do
        curl -sf localhost:8000/ready >/dev/null 2>&1 && break
        if ! pgrep -f "specfleet up" >/dev/null && [ $(( $(date +%s) - started )) -gt 60 ]; then
            tail -40 /tmp/run.log; echo "make run exited before the fleet was ready" >&2; exit 1
        fi
        sleep 2
    done
    echo "ready after $(( $(date +%s) - started )) s (install, model fetch and start)"
    .venv/bin/python -c "import llama_cpp" || echo "llama.cpp does not import: the fleet runs the distilled drafts" >&2
    curl -s localhost:8000/v1/chat/completions -H "Content-Type: application/json" -d "{\"model\": \"smollm2-135m-instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"temperature\": 0}"
    echo
    du -sh .venv .specfleet 2>/dev/null
'
