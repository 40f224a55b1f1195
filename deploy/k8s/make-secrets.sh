#!/usr/bin/env bash
# Write OVERLAY_DIR/secrets.env (git-ignored) with a random inter-service token and API key, the
# input of the overlay's secretGenerator. Keeps an existing file: delete it to rotate.
# Usage: deploy/k8s/make-secrets.sh deploy/k8s/overlays/<overlay>
set -euo pipefail
dir="${1:?usage: make-secrets.sh OVERLAY_DIR}"
[ -f "$dir/kustomization.yaml" ] || { echo "$dir has no kustomization.yaml" >&2; exit 1; }
out="$dir/secrets.env"
if [ -s "$out" ]; then
    echo "$out exists; keeping it"
    exit 0
fi
rand() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }
umask 077
printf 'auth-token=%s\napi-key=%s\n' "$(rand)" "$(rand)" >"$out"
echo "wrote $out (auth-token, api-key)"
