#!/usr/bin/env bash
# Make sure a Chromium binary is on PATH for the dashboard's browser test (tests/e2e/test_dashboard.py),
# installing Debian's package if it is missing (about 100 MB of downloads). It only installs.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/apt-ensure.sh"

for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "chromium already installed: $(command -v "$name") ($("$name" --version 2>/dev/null | head -n1))"
        exit 0
    fi
done
apt_ensure "Chromium (for the dashboard's browser test)" chromium
if ! command -v chromium >/dev/null 2>&1; then
    echo "apt-get finished but chromium is still not on PATH" >&2
    exit 1
fi
echo "installed: $(command -v chromium) ($(chromium --version | head -n1))"
