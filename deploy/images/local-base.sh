#!/usr/bin/env bash
# Build a local stand-in for the upstream base images from Debian bookworm packages alone
# (debootstrap --variant=minbase + podman import), for machines without an image registry.
# It has Python 3.11 (venv, pip), CA certificates, and redis-server (the ci overlay's Redis).
# Usage: [ARCH=arm64] deploy/images/local-base.sh [IMAGE]   (default: localhost/specfleet-base:bookworm)
# ARCH other than the host's needs qemu-user-static registered with binfmt_misc (debootstrap runs
# the second stage under emulation). Idempotent: does nothing if IMAGE already exists. Needs root.
set -euo pipefail

IMAGE="${1:-localhost/specfleet-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PKGS=python3,python3-venv,python3-pip,ca-certificates,redis-server,tini
ARCH="${ARCH:-$(dpkg --print-architecture)}"

# One build at a time (make test starts one early, beside the unit tests; the k8s tier's waits for it).
# Its lock and root filesystem are made in the repository's .specfleet/tmp, not /var/tmp.
TMP="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.specfleet/tmp"
mkdir -p "$TMP"
exec 9>"$TMP/specfleet-base-${IMAGE//[^A-Za-z0-9]/_}.lock"
flock 9
if podman image exists "$IMAGE"; then
    echo "base image $IMAGE already exists"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "debootstrap needs root; run this script as root (or with sudo)" >&2
    exit 1
fi
ROOTFS="$(mktemp -d "$TMP/specfleet-rootfs.XXXXXX")"
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap --variant=minbase --arch=$ARCH bookworm ($PKGS) from $MIRROR ..."
if ! debootstrap --variant=minbase --arch="$ARCH" --include="$PKGS" bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1; then
    tail -n 30 "$ROOTFS.log" >&2
    echo "debootstrap failed (log above: $ROOTFS.log); check that $MIRROR is reachable" >&2
    exit 1
fi
rm -f "$ROOTFS.log"
# Trim what a container never needs.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc \
       "$ROOTFS"/usr/share/man "$ROOTFS"/usr/share/locale
echo "podman import -> $IMAGE"
tar -C "$ROOTFS" -c . | podman import --arch "$ARCH" \
    --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$IMAGE" >/dev/null
podman image inspect --format '{{.Id}} {{.Size}}' "$IMAGE"
