#!/usr/bin/env bash
# Make sure a redis-server binary is on PATH, installing Debian's package if it is missing.
# It only installs: tests and deployments start their own server with their own settings.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/apt-ensure.sh"

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server already installed: $(command -v redis-server) ($(redis-server --version | head -n1))"
    exit 0
fi
apt_ensure "Redis >= 6.2 (XAUTOCLAIM)" redis-server
if ! command -v redis-server >/dev/null 2>&1; then
    echo "apt-get finished but redis-server is still not on PATH" >&2
    exit 1
fi
echo "installed: $(command -v redis-server) ($(redis-server --version | head -n1))"
