#!/usr/bin/env bash
# Stop every process of a job (or cluster) on this node: the job's process group, and anything
# else whose environment carries the marker (workers that started their own session).
#   usage: ctkill.sh JOB_DIR MARKER [GRACE_SECONDS]   (GRACE_SECONDS may have decimals: 0.5)
#   JOB_DIR may be empty; MARKER is KEY=VALUE, e.g. CLOUDTRAIN_JOB_ID=20261121-101500-ab12cd
# Prints "::left N" with the number of processes still alive at the end (0 when clean).
set -u
job_dir=$1
marker=$2
grace=${3:-5}

job_pids() {
    local f
    grep -lzxF "$marker" /proc/[0-9]*/environ 2>/dev/null | while read -r f; do
        f=${f#/proc/}
        echo "${f%/environ}"
    done
}

signal_all() {
    # The processes are listed before any is signalled: what a job starts in answer to SIGTERM
    # (a trap writing its checkpoint) is not signalled again.
    local sig=$1 p pids
    pids=$(job_pids)
    if [ -n "$job_dir" ] && [ -r "$job_dir/pid" ]; then
        kill "-$sig" -- "-$(cat "$job_dir/pid")" 2>/dev/null || true
    fi
    for p in $pids; do
        kill "-$sig" "$p" 2>/dev/null || true
    done
}

case $grace in
    *.*) whole=${grace%%.*} frac=${grace#*.} ;;
    *) whole=$grace frac= ;;
esac
frac="${frac}000000000"
# Alive: a process with the marker, or any process of the job's group (the job's own shell
# is in the group but has the marker only in what it exports to its children).
alive() {
    [ -n "$(job_pids)" ] && return 0
    [ -n "$job_dir" ] && [ -r "$job_dir/pid" ] && kill -0 -- "-$(cat "$job_dir/pid")" 2>/dev/null
}

signal_all TERM
end=$(( $(date +%s%N) + 10#${whole:-0} * 1000000000 + 10#${frac:0:9} ))
while alive && [ "$(date +%s%N)" -lt "$end" ]; do
    sleep 0.1
done
if alive; then
    signal_all KILL
    sleep 0.2
fi
left=$(job_pids | wc -l)
echo "::left $left"
