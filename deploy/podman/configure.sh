#!/usr/bin/env bash
# Write podman's and buildah's settings for this repository into DIR (default .specfleet/podman):
# containers.conf (from the template deploy/podman/containers.conf) and storage.conf (images and
# containers under DIR/storage; runtime state under /run/specfleet-podman, on tmpfs). Idempotent.
# Prints `export CONTAINERS_CONF=... CONTAINERS_STORAGE_CONF=...` for `eval`.
#   Usage: deploy/podman/configure.sh [DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="$(mkdir -p "${1:-$root/.specfleet/podman}" && cd "${1:-$root/.specfleet/podman}" && pwd)"
run=/run/specfleet-podman
mkdir -p "$dir/networks" "$dir/tmp" "$dir/storage"
sed -e "s|@DIR@|$dir|g" -e "s|@RUN@|$run|g" "$root/deploy/podman/containers.conf" >"$dir/containers.conf.new"
cat >"$dir/storage.conf.new" <<CONF
# written by deploy/podman/configure.sh
[storage]
driver = "overlay"
graphroot = "$dir/storage"
runroot = "$run/storage"
CONF
for f in containers.conf storage.conf; do
    if cmp -s "$dir/$f.new" "$dir/$f"; then rm -f "$dir/$f.new"; else mv "$dir/$f.new" "$dir/$f"; fi
done
echo "export CONTAINERS_CONF=$dir/containers.conf CONTAINERS_STORAGE_CONF=$dir/storage.conf"
