# Sourced by scripts/ensure-*.sh: install Debian packages with apt-get, as root or through sudo,
# with an actionable message where that cannot be done.
#   apt_ensure WHAT PACKAGE...    (WHAT names the need in messages)

apt_ensure() {
    local what=$1
    shift
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$what is not installed and apt-get is unavailable." >&2
        echo "Install $* with your package manager (brew, dnf, ...), then re-run this script." >&2
        return 1
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "$what is not installed, and installing it needs root (no sudo available)." >&2
            echo "Ask an administrator to run: apt-get update && apt-get install -y $*" >&2
            return 1
        fi
        sudo="sudo"
    fi
    echo "installing $* with apt-get ..."
    # package lists another ensure-* script just refreshed are used as they are; stale ones are refreshed
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" ||
        { $sudo env DEBIAN_FRONTEND=noninteractive apt-get update &&
          $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"; }
}
