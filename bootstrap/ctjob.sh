#!/usr/bin/env bash
# Start one job on this node, detached from the SSH session, and (unless --detach) stream its
# log until it ends, exiting with its exit code.
#   usage: ctjob.sh JOB_DIR [--detach]      (the job script comes on stdin)
# The job runs in its own session (setsid) so it can be stopped as a group; it survives the
# SSH connection dropping. Files in JOB_DIR: run.sh, node.log, pid, rc.
set -u
job_dir=$1
mode=${2:-}
mkdir -p "$job_dir"
cat > "$job_dir/run.sh"
: > "$job_dir/node.log"
# The wrapper outlives a SIGTERM to the group (trap :) so the log is followed, and rc written,
# while the job uses its stop_grace (e.g. to write a checkpoint).
# shellcheck disable=SC2016
setsid bash -c 'trap : TERM; bash "$1/run.sh"; rc=$?; echo "$rc" > "$1/rc.tmp"; mv "$1/rc.tmp" "$1/rc"' _ "$job_dir" \
    > "$job_dir/node.log" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$job_dir/pid"
if [ "$mode" = "--detach" ]; then
    echo "::started $pid"
    exit 0
fi
tail -n +1 -s 0.1 -F --pid="$pid" "$job_dir/node.log" 2>/dev/null
wait "$pid"
status=$?
if [ -r "$job_dir/rc" ]; then
    status=$(cat "$job_dir/rc")
else
    echo "$status" > "$job_dir/rc"
fi
exit "$status"
