#!/usr/bin/env bash
# cloudtrain node bootstrap: runs ON a node, as the login user, from the folder it was
# uploaded to. Finds what the node has (OS, NVIDIA GPUs, driver, CUDA toolkit, Python,
# PyTorch) and installs only what is missing, so a deep-learning image costs seconds. The
# runner (cloudtrain/bootstrap.py) reads the protocol lines described in lib.sh, times the
# steps, keeps this output as bootstrap.log on the node, and stamps the node when it is done.
# Installs also leave stamps in $STATE_DIR so a re-run after a failure redoes nothing twice.
#
# Inputs (environment), all optional:
#   CLOUDTRAIN_ROOT           the node's cloudtrain folder (default ~/cloudtrain): venv, stamps
#   CLOUDTRAIN_NODE_IP        the node's cluster address (to find the interface carrying it)
#   CLOUDTRAIN_PYTHON         a Python to use first (e.g. a local node's virtualenv)
#   CLOUDTRAIN_PYTHON_FIELD   set (to the task field, bootstrap.python) when the user asked
#                             for CLOUDTRAIN_PYTHON: then it must exist and run Python 3.9+,
#                             else the step fails naming the field and the path (exit 6)
#   CLOUDTRAIN_PYTHON_CANDIDATES  colon-separated Pythons to look at (default: the usual
#                             deep-learning image environments, then python3)
#   CLOUDTRAIN_TORCH          the pip requirement to install when PyTorch is missing (torch)
#   CLOUDTRAIN_TORCH_INDEX    the wheel index URL to install it from (default: from the table)
#   CLOUDTRAIN_TORCH_INDEX_BASE  where the table's index suffixes live
#   CLOUDTRAIN_CUDA_TOOLKIT   1: also install the CUDA toolkit (nvcc) where missing
#   CLOUDTRAIN_OS_RELEASE     the os-release file to read (tests)
#   CLOUDTRAIN_RCLONE         install: install rclone when missing (cloud nodes); check: only look
#   CLOUDTRAIN_CUDA_HOME      where a CUDA toolkit would be (default /usr/local/cuda)
#   CLOUDTRAIN_SLOTS          the node's GPU slot count for the job queue (default: its GPUs)
#   CLOUDTRAIN_CONTAINER      1: the task runs in a container (runtime.sh): the host gets the
#                             driver, Docker Engine and the NVIDIA Container Toolkit (with a
#                             GPU) and a Python for cloudtrain's own node scripts; no venv, no
#                             PyTorch, no CUDA toolkit (the image brings its own)
#   CLOUDTRAIN_CHECK_ONLY     1: find and report only, install nothing: a step that would
#                             install (a package, a driver, a virtualenv, PyTorch) fails with
#                             exit 7 saying what it would have installed (bench/gpu_preflight.sh)
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
cd "$(dirname "$0")"
TABLES=$PWD
# shellcheck source=lib.sh
. ./lib.sh
# shellcheck source=runtime.sh
. ./runtime.sh
# shellcheck source=fabric.sh
. ./fabric.sh
if [ "${CLOUDTRAIN_CHECK_ONLY:-0}" = 1 ]; then
    # Every install goes through one of these: refuse them all (lib.sh defines them).
    pkg_install() { FAIL_CODE=7 fail "check-only: would install $* (CLOUDTRAIN_CHECK_ONLY=1)"; }
    as_root() { FAIL_CODE=7 fail "check-only: would run as root: $* (CLOUDTRAIN_CHECK_ONLY=1)"; }
    download() { FAIL_CODE=7 fail "check-only: would download $1 (CLOUDTRAIN_CHECK_ONLY=1)"; }
    no_install_check() { FAIL_CODE=7 fail "check-only: would $* (CLOUDTRAIN_CHECK_ONLY=1)"; }
else
    no_install_check() { :; }
fi

ROOT=${CLOUDTRAIN_ROOT:-cloudtrain}
case "$ROOT" in /*) ;; *) ROOT=$HOME/$ROOT ;; esac
STATE_DIR=$ROOT/state
VENV=$ROOT/venv
NVIDIA_REPO_BASE=${CLOUDTRAIN_NVIDIA_REPO_BASE:-https://developer.download.nvidia.com/compute/cuda/repos}
TORCH_INDEX_BASE=${CLOUDTRAIN_TORCH_INDEX_BASE:-https://download.pytorch.org/whl}
INSTALLED=""
CONTAINER=${CLOUDTRAIN_CONTAINER:-0}
IN_IMAGE="the task runs in a container: its image brings its own"
mkdir -p "$STATE_DIR"

# ---------------------------------------------------------------------------------------------
step os
OS_ID=unknown OS_VERSION="" OS_LIKE=""
release=${CLOUDTRAIN_OS_RELEASE:-/etc/os-release}
if [ -r "$release" ]; then
    # shellcheck disable=SC1090
    OS_ID=$(. "$release" && echo "${ID:-unknown}")
    # shellcheck disable=SC1090
    OS_VERSION=$(. "$release" && echo "${VERSION_ID:-}")
    # shellcheck disable=SC1090
    OS_LIKE=$(. "$release" && echo "${ID_LIKE:-}")
fi
OS_NAME="$OS_ID $OS_VERSION"
ARCH=$(uname -m)
case "$ARCH" in
    x86_64) NVIDIA_ARCH=x86_64 ;;
    aarch64) NVIDIA_ARCH=sbsa ;;
    *) NVIDIA_ARCH="" ;;
esac
PKG=none NVIDIA_REPO=""
major=${OS_VERSION%%.*}
case "$OS_ID" in
    ubuntu)
        PKG=apt
        case "$OS_VERSION" in 20.04|22.04|24.04) NVIDIA_REPO="ubuntu${OS_VERSION/./}" ;; esac ;;
    debian)
        PKG=apt
        case "$major" in 11|12) NVIDIA_REPO="debian$major" ;; esac ;;
    rhel|rocky|almalinux|centos)
        PKG=dnf
        case "$major" in 8|9) NVIDIA_REPO="rhel$major" ;; esac ;;
    *)
        case " $OS_LIKE " in
            *" ubuntu "*|*" debian "*) PKG=apt ;;
            *" rhel "*|*" fedora "*) PKG=dnf ;;
        esac ;;
esac
[ -n "$NVIDIA_ARCH" ] || NVIDIA_REPO=""
result os "$OS_ID-$OS_VERSION"
result arch "$ARCH"
if [ "$PKG" = none ]; then
    found "$OS_NAME ($ARCH): not a system cloudtrain installs packages on; fine where nothing is missing"
else
    found "$OS_NAME ($ARCH), packages via $PKG"
fi

# ---------------------------------------------------------------------------------------------
step gpu
GPUS=0 GPU_NAME="" DRIVER=""
smi() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi "$@" 2>/dev/null; }
if q=$(smi --query-gpu=name,driver_version --format=csv,noheader) && [ -n "$q" ]; then
    GPUS=$(printf '%s\n' "$q" | grep -c .)
    GPU_NAME=$(printf '%s\n' "$q" | sed -n 1p | cut -d, -f1 | sed 's/^ *//; s/ *$//')
    DRIVER=$(printf '%s\n' "$q" | sed -n 1p | cut -d, -f2 | tr -d ' ')
else
    # No working driver: the PCI bus still shows the cards (3D/VGA controllers of vendor 10de).
    pci=""
    if command -v lspci >/dev/null 2>&1; then
        pci=$(lspci -nn 2>/dev/null | grep -E '\[(0300|0302)\]:.*\[10de:' || true)
    else
        for dev in /sys/bus/pci/devices/*; do
            [ -r "$dev/vendor" ] || continue
            if [ "$(cat "$dev/vendor")" = 0x10de ] && grep -qE '^0x030[02]' "$dev/class"; then
                pci="$pci${pci:+$'\n'}NVIDIA device $(cat "$dev/device")"
            fi
        done
    fi
    if [ -n "$pci" ]; then
        GPUS=$(printf '%s\n' "$pci" | grep -c .)
        GPU_NAME=$(printf '%s\n' "$pci" | sed -n 1p | sed -E 's/.*NVIDIA Corporation //; s/ \[10de:.*//')
    fi
fi
GEN="" GEN_MIN_DRIVER="" GEN_CUDA="" GEN_INDEX="" GEN_BRANCH=""
if [ "$GPUS" -gt 0 ]; then
    row=$(gpu_row "$GPU_NAME")
    if [ -n "$row" ]; then
        read -r GEN GEN_MIN_DRIVER GEN_CUDA GEN_INDEX GEN_BRANCH <<<"$row"
    else
        # A GPU the table does not know yet: the newest build and driver branch in the table.
        read -r GEN GEN_MIN_DRIVER GEN_CUDA GEN_INDEX GEN_BRANCH <<<"$(gpu_row B200)"
        GEN=unknown
    fi
    found "${GPUS}x $GPU_NAME ($GEN)${DRIVER:+, driver $DRIVER}"
else
    found "no NVIDIA GPU"
fi
result gpus "$GPUS"
result gpu_name "$GPU_NAME"
result gpu_gen "$GEN"
# The node's GPU slots, read by the job queue (node/queue.py slots, docs/queue.md): its GPUs,
# or the count the provider declares (CLOUDTRAIN_SLOTS: resources.local.gpus); 1 without.
SLOTS=${CLOUDTRAIN_SLOTS:-$GPUS}
case "$SLOTS" in ''|*[!0-9]*) SLOTS=1 ;; esac
[ "$SLOTS" -ge 1 ] || SLOTS=1
mkdir -p "$ROOT/.cloudtrain" && printf '%s\n' "$SLOTS" > "$ROOT/.cloudtrain/slots"
result slots "$SLOTS"

# ---------------------------------------------------------------------------------------------
step driver
if [ "$GPUS" = 0 ]; then
    skip "no GPU"
elif [ -n "$DRIVER" ]; then
    # A driver that is there stays: replacing one needs a reboot and may break the image.
    found "NVIDIA driver $DRIVER"
else
    [ -n "$NVIDIA_REPO" ] || FAIL_CODE=4 fail "this node has ${GPUS}x $GPU_NAME but no NVIDIA driver," \
        "and cloudtrain cannot install one on $OS_NAME ($ARCH)." \
        "Use an image with the driver (e.g. a deep-learning image), or Ubuntu 20.04-24.04 / Debian 11-12 / RHEL 8-9."
    nvidia_repo
    case "$PKG" in
        apt) pkg_install "linux-headers-$(uname -r)" "cuda-drivers-$GEN_BRANCH" ;;
        dnf) pkg_install "kernel-devel-$(uname -r)" "kernel-headers-$(uname -r)"
             as_root dnf module install -y -q "nvidia-driver:$GEN_BRANCH-dkms" ;;
    esac
    as_root modprobe nvidia || true
    q=$(smi --query-gpu=driver_version --format=csv,noheader) || q=""
    if [ -z "$q" ]; then
        FAIL_CODE=75 fail "the NVIDIA driver $GEN_BRANCH is installed but not loaded: the node needs a reboot." \
            "Reboot it (cloudtrain ssh NAME -- sudo reboot), then run 'cloudtrain up' again."
    fi
    DRIVER=$(printf '%s\n' "$q" | sed -n 1p | tr -d ' ')
    installed driver "NVIDIA driver $DRIVER (branch $GEN_BRANCH)"
fi
result driver "$DRIVER"

# ---------------------------------------------------------------------------------------------
if [ "$CONTAINER" = 1 ]; then
    docker_step
    toolkit_step
fi

# ---------------------------------------------------------------------------------------------
step cuda-toolkit
NVCC=$(command -v nvcc 2>/dev/null || true)
cuda_home=${CLOUDTRAIN_CUDA_HOME:-/usr/local/cuda}
if [ -z "$NVCC" ] && [ -x "$cuda_home/bin/nvcc" ]; then NVCC=$cuda_home/bin/nvcc; fi
if [ "$CONTAINER" = 1 ]; then
    skip "$IN_IMAGE CUDA"
elif [ -n "$NVCC" ]; then
    found "CUDA toolkit $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
elif [ "$GPUS" = 0 ]; then
    skip "no GPU"
elif [ "${CLOUDTRAIN_CUDA_TOOLKIT:-0}" != 1 ]; then
    skip "not asked for: PyTorch wheels carry their own CUDA runtime (set bootstrap.cuda_toolkit to build CUDA extensions)"
else
    nvidia_repo
    pkg_install "cuda-toolkit-${GEN_CUDA/./-}"
    installed cuda-toolkit "CUDA toolkit $GEN_CUDA in /usr/local/cuda-$GEN_CUDA"
fi

# ---------------------------------------------------------------------------------------------
step python
# One probe per candidate: its version, and PyTorch's version and CUDA build read from the
# package files (importing torch takes seconds; this takes milliseconds).
PROBE='
import importlib.metadata as m, importlib.util as u, os, re, sys
print("python=%d.%d.%d" % sys.version_info[:3])
try:
    print("torch=" + m.version("torch"))
    spec = u.find_spec("torch")
    text = open(os.path.join(os.path.dirname(spec.origin), "version.py")).read()
    hit = re.search(r"^cuda\S*\s*[:=].*?[\x27\x22]([0-9.]+)[\x27\x22]", text, re.M)
    print("torch_cuda=" + (hit.group(1) if hit else ""))
except Exception:
    print("torch=")
'
probe() {  # probe PYTHON -> sets P_PY P_TORCH P_CUDA; false if it does not run
    local out
    out=$("$1" -c "$PROBE" 2>/dev/null) || return 1
    P_PY=$(sed -n 's/^python=//p' <<<"$out")
    P_TORCH=$(sed -n 's/^torch=//p' <<<"$out")
    P_CUDA=$(sed -n 's/^torch_cuda=//p' <<<"$out")
}
asked_python() {  # the Python the task asked for must be there: say so, install nothing
    local py=$CLOUDTRAIN_PYTHON field=$CLOUDTRAIN_PYTHON_FIELD
    local fix="give the path of a python that is on every node, or remove $field to let cloudtrain find or install one."
    if [ -z "$py" ] || [ ! -e "$py" ]; then
        FAIL_CODE=6 fail "$field: '$py' does not exist on this node; $fix"
    elif [ -d "$py" ] || [ ! -x "$py" ]; then
        FAIL_CODE=6 fail "$field: '$py' on this node is not an executable file; $fix"
    elif ! probe "$py"; then
        FAIL_CODE=6 fail "$field: '$py' on this node does not run as Python; $fix"
    elif ! version_ge "$P_PY" 3.9; then
        FAIL_CODE=6 fail "$field: '$py' on this node is Python $P_PY; cloudtrain needs 3.9 or newer: $fix"
    fi
}
if [ -n "${CLOUDTRAIN_PYTHON_FIELD:-}" ]; then asked_python; fi
default_candidates="/opt/conda/envs/pytorch/bin/python:/opt/pytorch/bin/python3:/opt/conda/bin/python3"
candidates="${CLOUDTRAIN_PYTHON:-}:$VENV/bin/python:${CLOUDTRAIN_PYTHON_CANDIDATES:-$default_candidates}:$(command -v python3 2>/dev/null || true)"
PY="" PY_VERSION="" TORCH="" TORCH_CUDA="" first=""
IFS=: read -r -a cands <<<"$candidates"
for c in "${cands[@]}"; do
    if [ -z "$c" ] || [ ! -x "$c" ]; then continue; fi
    probe "$c" || continue
    version_ge "$P_PY" 3.9 || continue
    [ -n "$first" ] || first="$c|$P_PY"
    if [ -n "$P_TORCH" ] && [ "$CONTAINER" != 1 ]; then
        PY=$c PY_VERSION=$P_PY TORCH=$P_TORCH TORCH_CUDA=$P_CUDA
        break
    fi
done
if [ "$CONTAINER" = 1 ]; then
    # cloudtrain's own node scripts (guard, queue, storage) need a Python 3.9+ on the host,
    # nothing else: the job's Python is the image's.
    if [ -z "$first" ]; then
        pkg_install python3
        if ! probe "$(command -v python3)" || ! version_ge "$P_PY" 3.9; then
            FAIL_CODE=6 fail "this node has no Python 3.9 or newer, which cloudtrain's node" \
                "scripts need on the host, and the OS's python3 is older."
        fi
        first="$(command -v python3)|$P_PY"
        PY=${first%%|*} PY_VERSION=${first#*|}
        installed python "$PY (Python $PY_VERSION, for cloudtrain's node scripts)"
    else
        PY=${first%%|*} PY_VERSION=${first#*|}
        found "$PY (Python $PY_VERSION, for cloudtrain's node scripts; the job's is the image's)"
    fi
elif [ -n "$PY" ]; then
    found "$PY (Python $PY_VERSION, with PyTorch)"
elif [ -n "${CLOUDTRAIN_PYTHON:-}" ] && [ "${first%%|*}" = "$CLOUDTRAIN_PYTHON" ]; then
    PY=$CLOUDTRAIN_PYTHON PY_VERSION=${first#*|}
    found "$PY (Python $PY_VERSION, the environment asked for)"
elif [ -n "$first" ] && [ "${first%%|*}" = "$VENV/bin/python" ]; then
    PY=$VENV/bin/python PY_VERSION=${first#*|}
    found "$PY (Python $PY_VERSION)"
else
    # Our own virtualenv, so installs never touch the image's Python.
    no_install_check "create a virtualenv in $VENV"
    base=${first%%|*}
    if [ -z "$base" ] || ! "$base" -m venv --help >/dev/null 2>&1; then
        pkg_install python3 python3-venv python3-pip
        base=$(command -v python3)
    fi
    "$base" -m venv "$VENV" || fail "could not create a virtualenv in $VENV with $base."
    PY=$VENV/bin/python
    probe "$PY" || fail "the new virtualenv's python in $VENV does not run."
    PY_VERSION=$P_PY
    installed venv "virtualenv $VENV (Python $PY_VERSION)"
fi
result python_bin "$(dirname "$PY")"
result python_version "$PY_VERSION"

# ---------------------------------------------------------------------------------------------
step torch
if [ "$CONTAINER" = 1 ]; then
    skip "$IN_IMAGE PyTorch"
elif [ -n "$TORCH" ]; then
    found "PyTorch $TORCH${TORCH_CUDA:+ (CUDA $TORCH_CUDA)}"
else
    if [ -n "${CLOUDTRAIN_TORCH_INDEX:-}" ]; then
        index=$CLOUDTRAIN_TORCH_INDEX
    elif [ "$GPUS" -gt 0 ]; then
        version_ge "$DRIVER" "$GEN_MIN_DRIVER" || FAIL_CODE=5 fail \
            "NVIDIA driver $DRIVER is older than $GEN_MIN_DRIVER, which the CUDA $GEN_CUDA build of PyTorch" \
            "needs on $GEN GPUs: CUDA would be unavailable to training." \
            "Use an image with a newer driver, or upgrade it (sudo apt-get install cuda-drivers-$GEN_BRANCH) and reboot."
        index=$TORCH_INDEX_BASE/$GEN_INDEX
    else
        index=$TORCH_INDEX_BASE/cpu
    fi
    req=${CLOUDTRAIN_TORCH:-torch}
    no_install_check "pip install $req from $index"
    "$PY" -m pip install -q --disable-pip-version-check --index-url "$index" "$req" numpy \
        || fail "pip could not install '$req' from $index (see the lines above)." \
                "Check the node reaches $index, or set bootstrap.torch / bootstrap.torch_index in the task."
    if ! probe "$PY" || [ -z "$P_TORCH" ]; then fail "PyTorch was installed but '$PY' cannot find it."; fi
    TORCH=$P_TORCH TORCH_CUDA=$P_CUDA
    installed torch "PyTorch $TORCH${TORCH_CUDA:+ (CUDA $TORCH_CUDA)} from $index"
fi
result torch "$TORCH"
result torch_cuda "$TORCH_CUDA"

# ---------------------------------------------------------------------------------------------
step cuda-check
# Caught here, not 20 minutes into a job: a PyTorch that cannot use this node's GPUs.
if [ "$CONTAINER" = 1 ]; then
    skip "$IN_IMAGE PyTorch"
elif [ "$GPUS" = 0 ]; then
    skip "no GPU"
elif [ -z "$TORCH_CUDA" ]; then
    FAIL_CODE=5 fail "PyTorch $TORCH in $PY is a CPU-only build on a node with ${GPUS}x $GPU_NAME:" \
        "training would silently run on the CPU." \
        "Install a CUDA build ($PY -m pip install torch --index-url $TORCH_INDEX_BASE/$GEN_INDEX) or point bootstrap at another environment."
else
    need=$(cuda_min_driver "$TORCH_CUDA")
    if [ -n "$need" ] && ! version_ge "$DRIVER" "$need"; then
        FAIL_CODE=5 fail "NVIDIA driver $DRIVER is too old for PyTorch $TORCH (CUDA $TORCH_CUDA needs driver $need or newer):" \
            "CUDA would be unavailable to training." \
            "Install a PyTorch built for an older CUDA ($TORCH_INDEX_BASE/cu118 works from driver 450.80), or use an image with a newer driver."
    fi
    stamp="$STATE_DIR/cuda-ok-$TORCH-$DRIVER-$GPUS"
    if [ -f "$stamp" ]; then
        found "checked before: PyTorch $TORCH sees the GPUs (driver $DRIVER)"
    else
        seen=$("$PY" -c 'import torch; assert torch.cuda.is_available(), "torch.cuda.is_available() is False"; print(torch.cuda.device_count())' 2>&1 | tail -n1) || seen=""
        if ! [[ "$seen" =~ ^[0-9]+$ ]] || [ "$seen" -lt 1 ]; then
            FAIL_CODE=5 fail "PyTorch $TORCH cannot use the GPUs with driver $DRIVER (${seen:-no answer})." \
                "Check 'nvidia-smi' on the node; a reboot after a driver install often fixes this."
        fi
        touch "$stamp"
        found "PyTorch $TORCH sees $seen GPU(s)"
    fi
fi

# ---------------------------------------------------------------------------------------------
step rclone
# Bucket file_mounts and checkpoints move through rclone (cloudtrain/node/store.py drives it).
# Cloud nodes get it when missing (the distro package, else rclone's official release zip,
# checked against its SHA256SUMS); on local/ssh nodes cloudtrain installs nothing system-wide:
# the result says 'missing' and a task that needs buckets is stopped with the fix.
RCLONE_V=missing
if command -v rclone >/dev/null 2>&1; then
    RCLONE_V=$(rclone version 2>/dev/null | awk 'NR == 1 {print $2}')
    found "rclone ${RCLONE_V:-?}"
elif [ "${CLOUDTRAIN_RCLONE:-check}" = install ]; then
    if [ "$PKG" = apt ] && pkg_install rclone >/dev/null 2>&1 && command -v rclone >/dev/null 2>&1; then
        :
    else
        rarch=""
        case "$ARCH" in x86_64) rarch=amd64 ;; aarch64) rarch=arm64 ;; esac
        [ -n "$rarch" ] || fail "rclone is needed for buckets and there is no release for $ARCH."
        rver=v1.68.2   # the one place the installed rclone's version is written
        rbase=${CLOUDTRAIN_RCLONE_BASE:-https://downloads.rclone.org/$rver}
        rzip="rclone-$rver-linux-$rarch.zip"
        rtmp=$(mktemp -d)
        download "$rbase/$rzip" "$rtmp/$rzip"
        download "$rbase/SHA256SUMS" "$rtmp/SHA256SUMS"
        (cd "$rtmp" && grep " $rzip\$" SHA256SUMS | sha256sum -c --status) \
            || fail "the rclone download did not match its SHA256SUMS." "Try again later."
        python3 -m zipfile -e "$rtmp/$rzip" "$rtmp/x"
        as_root install -m 0755 "$rtmp/x/${rzip%.zip}/rclone" /usr/local/bin/rclone
        rm -rf "$rtmp"
    fi
    RCLONE_V=$(rclone version 2>/dev/null | awk 'NR == 1 {print $2}')
    installed rclone "rclone ${RCLONE_V:-?}"
else
    skip "rclone is not installed (needed only for bucket file_mounts and checkpoints: apt-get install rclone)"
fi
result rclone "$RCLONE_V"

fabric_check   # the fast network, where the provider set one up (fabric.sh)

# ---------------------------------------------------------------------------------------------
step network
iface=""
if [ -n "${CLOUDTRAIN_NODE_IP:-}" ] && command -v ip >/dev/null 2>&1; then
    # The interface that holds the address, else the one the kernel routes it through
    # (a 127.x address on loopback is routed via lo without being assigned to it).
    # (awk reads all its input: an early exit would SIGPIPE ip, fatal under pipefail)
    iface=$(ip -o -4 addr show | awk -v ip="$CLOUDTRAIN_NODE_IP" '!f {split($4, a, "/"); if (a[1] == ip) {print $2; f = 1}}')
    if [ -z "$iface" ]; then
        iface=$(ip -o route get "$CLOUDTRAIN_NODE_IP" 2>/dev/null | awk '!f {for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); f = 1; break}}')
    fi
fi
if [ -n "$iface" ]; then found "cluster traffic on $iface"; else skip "no cluster address given"; fi
result iface "$iface"
result installed "$INSTALLED"
