#!/usr/bin/env bash
# Prepare a fresh machine for the demo and the tests: system packages (when root with apt),
# then a virtual environment in .venv with cloudtrain (editable), its dev extras and PyTorch.
# Safe to run again: it only installs what is missing.
# --tests: also what only the tests need: npm (Azurite), and Docker (docker.io, docker-registry,
# apache2-utils, debootstrap), whose Engine it starts with scripts/dockerd.sh when none answers.
# Quiet: what apt, pip and npm print goes to .venv/setup.log (kept from the last run that
# installed something); a step that fails shows the log's last lines and its path.
# CLOUDTRAIN_TORCH_INDEX=URL: take PyTorch from that wheel index (e.g. the CPU-only build from
# https://download.pytorch.org/whl/cpu; PyPI's torch on Linux x86_64 is the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

LOG=.venv/setup.log
# This run's output collects in a temporary file: it becomes $LOG when the run installed
# something (or failed), so the log is always the last install's, never an ever-growing one.
TMPLOG=$(mktemp "${TMPDIR:-/tmp}/cloudtrain-setup.XXXXXX")
placed_policy=   # a policy-rc.d this run put in place (below), removed however it ends
trap 'rm -f "$TMPLOG"; [ -z "$placed_policy" ] || rm -f "$placed_policy"' EXIT

# Where the log is kept: in .venv once it exists, else next to the temporary file.
keep_log() {
    local dest=$LOG
    [ -d .venv ] || dest=${TMPDIR:-/tmp}/cloudtrain-setup.log
    cp "$TMPLOG" "$dest"
    echo "$dest"
}

# Progress, for a person watching a terminal only (a run that installs takes minutes).
say() { if [ -t 1 ]; then echo "setup: $*"; fi; }

# quietly WHAT CMD...: run CMD with its output going to the log; on failure say WHAT failed,
# show the log's last 40 lines and where the whole log is, and stop with CMD's exit code.
quietly() {
    local what=$1 rc=0 kept
    shift
    printf '\n$ %s\n' "$*" >>"$TMPLOG"
    "$@" >>"$TMPLOG" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        kept=$(keep_log)
        echo "setup: $what failed (exit $rc); the last 40 lines of its output:" >&2
        tail -n 40 "$kept" | sed 's/^/  | /' >&2
        echo "setup: the whole log: $kept" >&2
        exit "$rc"
    fi
}

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
# --tests: Docker (the container tests: an Engine, a loopback registry with htpasswd auth, and
# debootstrap for the tests' torch image, tests/dockerkit.py). dockerd, not docker: a static
# client alone (/usr/local/bin/docker on some images) has no Engine.
if [ "$for_tests" = 1 ]; then
    command -v dockerd >/dev/null 2>&1 || { need+=(docker.io); no_start=1; }
    command -v docker-registry >/dev/null 2>&1 || need+=(docker-registry)
    command -v htpasswd >/dev/null 2>&1 || need+=(apache2-utils)
    command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
fi
# --tests: a Slurm cluster of the tests' own (tests/slurmkit.py): Slurm, munge, slurmdbd, MariaDB
# (no_start: their postinst would start the system's munged and mariadbd; the tests start theirs)
if [ "$for_tests" = 1 ]; then
    for d in slurmctld slurmd slurmdbd mariadbd munged; do
        [ -x "/usr/sbin/$d" ] && continue
        need+=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server); no_start=1; break
    done
fi
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing ${need[*]} (apt)"
        quietly "apt-get update" apt-get update
        # docker.io's postinst would start a default dockerd (docker0, iptables rules, FORWARD
        # policy DROP, ip_forward on: ../shared/REALPARTS.md). Debian's policy-rc.d, where
        # none is in place, keeps it from starting any service; dockerd.sh starts ours below.
        # (CLOUDTRAIN_POLICY_RC_D: another path, for the tests of this script)
        policy=${CLOUDTRAIN_POLICY_RC_D:-/usr/sbin/policy-rc.d}
        if [ "${no_start:-0}" = 1 ] && [ ! -e "$policy" ]; then
            placed_policy=$policy
            printf '#!/bin/sh\nexit 101\n' >"$placed_policy"
            chmod 755 "$placed_policy"
        fi
        quietly "apt-get install ${need[*]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y "${need[@]}"
        [ -z "$placed_policy" ] || { rm -f "$placed_policy"; placed_policy=; }
    else
        echo "setup: please install: ${need[*]} (e.g. sudo apt-get install ${need[*]})" >&2
        exit 1
    fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    quietly "creating .venv with $PY" "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import cloudtrain, torch, pytest, paramiko, xdist" >/dev/null 2>&1 \
        || [ pyproject.toml -nt .venv/.installed ] || [ constraints-dev.txt -nt .venv/.installed ]; then
    say "installing cloudtrain (editable), its dev extras and PyTorch into .venv (log: $LOG)"
    pip=(.venv/bin/python -m pip --disable-pip-version-check)
    quietly "pip install --upgrade pip" "${pip[@]}" install --upgrade pip
    if [ -n "${CLOUDTRAIN_TORCH_INDEX:-}" ]; then
        quietly "pip install torch from $CLOUDTRAIN_TORCH_INDEX" "${pip[@]}" install \
            -c constraints-dev.txt --index-url "$CLOUDTRAIN_TORCH_INDEX" torch
    fi
    quietly "pip install" "${pip[@]}" install -c constraints-dev.txt torch numpy -e ".[dev]"
    touch .venv/.installed
fi
# Azurite (the Azure Blob emulator the storage tests start) from npm, into tests/.npm (without
# Node.js, where apt could not install it, those tests say what is missing).
if [ "$for_tests" = 1 ] && [ ! -x tests/.npm/node_modules/.bin/azurite-blob ]; then
    if command -v npm >/dev/null 2>&1; then
        say "installing azurite (npm) into tests/.npm"
        printf '\n$ npm install azurite@3\n' >>"$TMPLOG"
        if ! npm install --prefix tests/.npm --no-audit --no-fund --loglevel=error azurite@3 \
                >>"$TMPLOG" 2>&1; then
            kept=$(keep_log)
            echo "setup: warning: 'npm install azurite' failed; the Azure storage tests will fail." \
                 "Its last 40 lines:" >&2
            tail -n 40 "$kept" | sed 's/^/  | /' >&2
            echo "setup: the whole log: $kept" >&2
        fi
    else
        echo "setup: note: no npm here; install Node.js to run the Azure Blob storage tests" >&2
    fi
fi
# --tests: a Docker Engine that answers: scripts/dockerd.sh leaves a running one as it is, else
# starts one with no bridge and no firewall change (apt may not start it: policy-rc.d).
if [ "$for_tests" = 1 ] && ! bash scripts/dockerd.sh; then
    echo "setup: no Docker Engine answers and none could be started (above); the container" \
         "tests need one: start Docker (as root: bash scripts/dockerd.sh), then run this again" >&2
    exit 1
fi
# --tests: the tests' torch image (tests/dockerkit.py: built once per machine, 2.5 to 5 min)
# starts building in the background when it is missing; the tests that use it wait for it.
if [ "$for_tests" = 1 ] && [ -f tests/dockerkit.py ] \
        && ! .venv/bin/python tests/dockerkit.py torch --check >/dev/null 2>&1; then
    nohup setsid .venv/bin/python tests/dockerkit.py torch >.venv/torch-image.log 2>&1 </dev/null &
    echo "setup: building the tests' torch image in the background (log: .venv/torch-image.log)"
fi
if [ -s "$TMPLOG" ]; then keep_log >/dev/null; fi   # this run installed: its log replaces the last
echo "setup: ready ($(.venv/bin/python -c 'import torch, cloudtrain; print("cloudtrain", cloudtrain.__version__, "torch", torch.__version__)'))"
