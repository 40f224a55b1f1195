#!/usr/bin/env bash
# Make sure a redis-server binary is on PATH, installing Debian's package if it is missing.
# It only installs: tests and deployments start their own server with their own settings.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server already installed: $(command -v redis-server) ($(redis-server --version | head -n1))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "redis-server not found and apt-get is unavailable." >&2
    echo "Install Redis >= 6.2 (XAUTOCLAIM) with your package manager, e.g. 'brew install redis'" >&2
    echo "or 'dnf install redis', then re-run this script." >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "redis-server not found, and installing it needs root (no sudo available)." >&2
    echo "Ask an administrator to run: apt-get update && apt-get install -y redis-server" >&2
    exit 1
fi

echo "installing redis-server with apt-get ..."
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server

if ! command -v redis-server >/dev/null 2>&1; then
    echo "apt-get finished but redis-server is still not on PATH" >&2
    exit 1
fi
echo "installed: $(command -v redis-server) ($(redis-server --version | head -n1))"
