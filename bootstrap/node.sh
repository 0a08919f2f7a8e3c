#!/usr/bin/env bash
# cloudtrain node bootstrap: runs ON a node, as the login user, from the folder it was
# uploaded to. It finds what the node has and reports it; each step is announced with
# "::step NAME" and each finding with "::result KEY=VALUE" so the runner can time the steps
# and record the findings. Idempotence is the runner's job (a stamp per script version).
#
# Inputs (environment):
#   CLOUDTRAIN_NODE_IP   the node's cluster address (to find the interface carrying it)
#   CLOUDTRAIN_PYTHON    optional: the python of the environment to use (local nodes)
set -euo pipefail

step() { echo "::step $1"; }
result() { echo "::result $1=$2"; }

step detect-os
os_id=unknown
if [ -r /etc/os-release ]; then
    # shellcheck disable=SC1091
    . /etc/os-release
    os_id="${ID:-unknown}-${VERSION_ID:-}"
fi
result os "$os_id"
result arch "$(uname -m)"

step detect-gpu
gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L | grep -c '^GPU' || true)
fi
result gpus "$gpus"

step detect-network
iface=""
if [ -n "${CLOUDTRAIN_NODE_IP:-}" ] && command -v ip >/dev/null 2>&1; then
    # The interface that holds the address, else the one the kernel routes it through
    # (a 127.x address on loopback is routed via lo without being assigned to it).
    iface=$(ip -o -4 addr show | awk -v ip="$CLOUDTRAIN_NODE_IP" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')
    if [ -z "$iface" ]; then
        iface=$(ip -o route get "$CLOUDTRAIN_NODE_IP" 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')
    fi
fi
result iface "${iface:-}"

step python
py=""
if [ -n "${CLOUDTRAIN_PYTHON:-}" ] && [ -x "${CLOUDTRAIN_PYTHON}" ]; then
    py="$CLOUDTRAIN_PYTHON"
elif command -v python3 >/dev/null 2>&1; then
    py=$(command -v python3)
fi
if [ -z "$py" ]; then
    echo "no python3 on this node" >&2
    exit 3
fi
result python_bin "$(dirname "$py")"
result python_version "$("$py" -c 'import platform; print(platform.python_version())')"
# The installed version from package metadata: fast (importing torch takes seconds); issue-3's
# checks that CUDA really works run where a GPU is present.
torch_version=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo missing)
result torch "$torch_version"
