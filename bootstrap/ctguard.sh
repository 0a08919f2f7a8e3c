#!/usr/bin/env bash
# Install, (re)start and renew the node guard (cloudtrain/node/guard.py) on this node.
#   usage: ctguard.sh ROOT PYTHON CLUSTER_ID RANK MODE [POLICY_JSON]
#   MODE install: write POLICY_JSON, clear an old stop, renew the lease, start the guard
#        policy:  write POLICY_JSON; renew the lease; start the guard if it is not running
#        touch:   renew the lease (a CLI contact); start the guard if it is not running
#   (guard.py and sessions.py come on stdin in these three modes, NUL between them, and
#   are written when missing or changed)
#        state:   print what the guard last saw (one JSON line)
# Supervision: a systemd unit where systemd is PID 1 and sudo needs no password; otherwise a
# background shell loop in its own session that restarts the guard when it dies. The lifetime
# deadman runs as a process of its own in both cases. Every process carries
# CLOUDTRAIN_CLUSTER_ID, so 'down' on machines cloudtrain does not own stops them too.
set -u
root=$1 py=$2 uid=$3 rank=$4 mode=$5 policy=${6:-}
case $root in /*) ;; *) root=$HOME/$root ;; esac
d=$root/.cloudtrain/guard
umask 077
# Every launch and exec runs this: the common path uses bash builtins only (no process
# started), so a contact costs the node a shell and nothing more.
[ -d "$d" ] || mkdir -p "$d" || exit 1
[ -x "$py" ] || py=$(command -v "$py" || command -v python3 || command -v python || echo python3)
export CLOUDTRAIN_CLUSTER_ID=$uid CT_GUARD_RANK=$rank

if [ "$mode" = state ]; then
    exec "$py" "$d/guard.py" state "$root"
fi
# guard.py, a NUL, then sessions.py (which it imports) come on stdin in every other mode:
# each written when it is missing or changed.
ship() {
    local new='' old=''
    IFS= read -r -d '' new || true
    [ -r "$d/$1" ] && { IFS= read -r -d '' old < "$d/$1" || true; }
    if [ -n "$new" ] && [ "$new" != "$old" ]; then
        printf '%s' "$new" > "$d/$1.tmp.$$" && mv "$d/$1.tmp.$$" "$d/$1" || exit 1
    fi
}
ship guard.py
ship sessions.py
if [ "$mode" = install ]; then
    [ -e "$d/stopped.json" ] && rm -f "$d/stopped.json"
    [ -s "$d/state.json" ] && : > "$d/state.json"    # what the guard saw: forgotten
fi
# Written in place (no process for a rename): the guard keeps its last good policy when a
# read finds the file mid-write.
[ -n "$policy" ] && printf '%s\n' "$policy" > "$d/policy.json"
printf -v now '%(%s)T' -1
printf '{"at": %s}\n' "$now" > "$d/lease"   # one short write: read whole or not at all
[ -e "$d/stopped.json" ] && { echo "::guard stopped"; exit 0; }

running() {  # PIDFILE WORD: the pid in PIDFILE is alive and its command line has WORD
    local p='' args=()
    { read -r p < "$1" || [ -n "$p" ]; } 2>/dev/null || return 1   # no newline at the end: ok
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null || return 1
    { mapfile -d '' -t args < "/proc/$p/cmdline"; } 2>/dev/null || return 1
    [[ " ${args[*]} " == *"$2"* ]]
}

how=process init=''
{ read -r init < /proc/1/comm; } 2>/dev/null
if [ "$init" = systemd ] && [ -z "${CT_GUARD_NO_SYSTEMD:-}" ] && sudo -n true 2>/dev/null; then
    how=systemd
    unit=cloudtrain-guard-$(printf '%s' "$root" | cksum | cut -d' ' -f1)
    if [ "$mode" = install ] || [ ! -e "/etc/systemd/system/$unit.service" ]; then
        sudo -n tee "/etc/systemd/system/$unit.service" > /dev/null <<UNIT
[Unit]
Description=cloudtrain node guard ($root)
After=network.target

[Service]
User=$(id -un)
Environment=HOME=$HOME CLOUDTRAIN_CLUSTER_ID=$uid CT_GUARD_RANK=$rank
ExecStart=$py $d/guard.py run $root
Restart=on-failure
RestartSec=1

[Install]
WantedBy=multi-user.target
UNIT
        sudo -n systemctl daemon-reload && sudo -n systemctl enable "$unit" > /dev/null 2>&1
    fi
    sudo -n systemctl is-active --quiet "$unit" || sudo -n systemctl restart "$unit"
elif ! running "$d/supervisor.pid" ctguard-supervisor && ! running "$d/guard.pid" "guard.py run"; then
    # shellcheck disable=SC2016
    setsid bash -c 'echo $$ > "$1/supervisor.pid"
        while [ ! -e "$1/stopped.json" ]; do
            "$2" "$1/guard.py" run "$3" >> "$1/guard.out" 2>&1; rc=$?
            [ -e "$1/stopped.json" ] && break
            echo "$(date +%Y-%m-%dT%H:%M:%S) rank=$CT_GUARD_RANK guard exited (rc $rc): restarted" >> "$1/guard.log"
            sleep 1
        done' ctguard-supervisor "$d" "$py" "$root" < /dev/null > /dev/null 2>&1 &
fi
if ! running "$d/deadman.pid" "guard.py deadman"; then
    setsid "$py" "$d/guard.py" deadman "$root" < /dev/null >> "$d/guard.out" 2>&1 &
fi
echo "::guard $how"
