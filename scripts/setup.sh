#!/usr/bin/env bash
# Prepare a fresh machine for the demo and the tests: system packages (when root with apt),
# then a virtual environment in .venv with cloudtrain (editable), its dev extras and PyTorch.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v pgrep >/dev/null 2>&1 || need+=(procps)
command -v rclone >/dev/null 2>&1 || need+=(rclone)   # buckets: the nodes' transfers (docs/storage.md)
# --tests: also what only the tests need (npm, for Azurite, the Azure Blob emulator)
for_tests=0; [ "${1:-}" = "--tests" ] && for_tests=1
[ "$for_tests" = 1 ] && { command -v npm >/dev/null 2>&1 || need+=(npm); }
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "setup: please install: ${need[*]} (e.g. sudo apt-get install ${need[*]})" >&2
        exit 1
    fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import cloudtrain, torch, pytest, paramiko" >/dev/null 2>&1 \
        || [ pyproject.toml -nt .venv/.installed ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -c constraints-dev.txt torch numpy -e ".[dev]"
    touch .venv/.installed
fi
# Azurite (the Azure Blob emulator the storage tests start) from npm, into tests/.npm (without
# Node.js, where apt could not install it, those tests say what is missing).
if [ "$for_tests" = 1 ] && [ ! -x tests/.npm/node_modules/.bin/azurite-blob ]; then
    if command -v npm >/dev/null 2>&1; then
        npm install --prefix tests/.npm --no-audit --no-fund --loglevel=error azurite@3 >/dev/null \
            || echo "setup: warning: 'npm install azurite' failed; the Azure storage tests will fail" >&2
    else
        echo "setup: note: no npm here; install Node.js to run the Azure Blob storage tests" >&2
    fi
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch, cloudtrain; print("cloudtrain", cloudtrain.__version__, "torch", torch.__version__)'))"
