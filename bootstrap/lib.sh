# shellcheck shell=bash
# Helpers for node.sh: the runner protocol, privileges, package installs, version checks and
# the version tables. Sourced, never run.
#
# Protocol on stdout, read by cloudtrain/bootstrap.py (every other line is log):
#   ::step NAME          a step starts (timed until the next step)
#   ::found TEXT         what the step found already there
#   ::installed TEXT     what the step installed
#   ::skip TEXT          why the step did nothing
#   ::result KEY=VALUE   a fact recorded in the cluster state
#   ::fail TEXT          what went wrong and what to do (then exit non-zero)

step() { echo "::step $1"; }
found() { echo "::found $*"; }
installed() { echo "::installed $*"; INSTALLED="${INSTALLED:+$INSTALLED,}$1"; }
skip() { echo "::skip $*"; }
result() { echo "::result $1=$2"; }
fail() { echo "::fail $*"; exit "${FAIL_CODE:-3}"; }

# Run a command as root: directly when we are root, else through passwordless sudo.
as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        fail "installing needs root: '$*' cannot run because $(id -un) has no passwordless sudo." \
             "Use an image where the login user has it (every cloud image does), or install it by hand."
    fi
}

# version_ge A B: A >= B for dotted numeric versions (535.104.05 >= 525.60.13).
version_ge() {
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -t. -k1,1n -k2,2n -k3,3n | sed -n 1p)" = "$2" ]
}

# The row of versions.tsv whose pattern matches a GPU name: "gen min_driver cuda index branch".
gpu_row() {
    awk -F '\t' -v name="$1" '
        /^#/ || $1 == "generation" || NF < 6 { next }
        { if (tolower(name) ~ tolower($2)) { print $1, $3, $4, $5, $6; exit } }' "$TABLES/versions.tsv"
}

# The oldest driver that runs a given CUDA build of PyTorch (cuda_drivers.tsv), empty if unknown.
cuda_min_driver() {
    awk -F '\t' -v cuda="$1" '!/^#/ && $1 == cuda { print $2; exit }' "$TABLES/cuda_drivers.tsv"
}

# Package installs through the OS's manager, with the NVIDIA CUDA repository where needed.
pkg_install() {
    case "$PKG" in
        apt)
            if [ -z "${APT_UPDATED:-}" ]; then
                as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
                APT_UPDATED=1
            fi
            as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
            ;;
        dnf) as_root dnf install -y -q "$@" ;;
        *) fail "cannot install $* on $OS_NAME: cloudtrain installs packages on Ubuntu 20.04-24.04," \
                "Debian 11-12 and RHEL/Rocky/Alma 8-9." \
                "Use an image that already has them (a deep-learning image), or install them by hand." ;;
    esac
}

download() {  # download URL FILE
    if command -v curl >/dev/null 2>&1; then
        curl -fsSL --retry 3 --connect-timeout 20 -o "$2" "$1"
    elif command -v wget >/dev/null 2>&1; then
        wget -q --tries=3 --timeout=20 -O "$2" "$1"
    else
        fail "neither curl nor wget is on this node to download $1."
    fi
}

# Add NVIDIA's CUDA repository (drivers and toolkit) once.
nvidia_repo() {
    [ -n "${NVIDIA_REPO_ADDED:-}" ] && return 0
    [ -n "$NVIDIA_REPO" ] || fail "NVIDIA publishes no CUDA repository for $OS_NAME." \
        "Use a deep-learning image with the driver, or Ubuntu 20.04-24.04 / Debian 11-12 / RHEL 8-9."
    local base="$NVIDIA_REPO_BASE/$NVIDIA_REPO/$NVIDIA_ARCH"
    case "$PKG" in
        apt)
            local deb="$STATE_DIR/cuda-keyring.deb"
            download "$base/cuda-keyring_1.1-1_all.deb" "$deb"
            as_root dpkg -i "$deb"
            APT_UPDATED=""
            ;;
        dnf)
            as_root dnf config-manager --add-repo "$base/cuda-$NVIDIA_REPO.repo"
            ;;
    esac
    NVIDIA_REPO_ADDED=1
}
