#!/usr/bin/env bash
# Start one job on this node, detached from the SSH session, and (unless --detach) stream its
# log until it ends, exiting with its exit code.
#   usage: ctjob.sh JOB_DIR [--detach]      (the job script comes on stdin)
# The job runs in its own session (setsid) so it can be stopped as a group; it survives the
# SSH connection dropping. Files in JOB_DIR: run.sh, node.log, pid, rc.
set -u
job_dir=$1
mode=${2:-}
# run.sh holds the task's envs (secrets): the job folder is private (0700, files 0600); the job
# itself runs with the caller's umask. Old job folders are pruned: the newest
# ${CLOUDTRAIN_KEEP_JOBS:-20} are kept, and never one whose job still runs.
job_umask=$(umask)
umask 077
mkdir -p "$job_dir" && chmod 700 "$job_dir" "$(dirname "$job_dir")"
cat > "$job_dir/run.sh"
: > "$job_dir/node.log"
umask "$job_umask"
keep=${CLOUDTRAIN_KEEP_JOBS:-20}
# shellcheck disable=SC2012  # job folder names are cloudtrain's own (timestamp-hex)
ls -1dt -- "$(dirname "$job_dir")"/*/ 2>/dev/null | tail -n +$((keep + 1)) | while IFS= read -r d; do
    d=${d%/}
    [ "$d" = "$job_dir" ] && continue
    if [ ! -e "$d/rc" ] && { [ ! -e "$d/pid" ] || kill -0 "$(cat "$d/pid" 2>/dev/null)" 2>/dev/null; }; then
        continue  # still running (or being started)
    fi
    rm -rf -- "$d"
done
# shellcheck disable=SC2016
setsid bash -c 'bash "$1/run.sh"; rc=$?; echo "$rc" > "$1/rc.tmp"; mv "$1/rc.tmp" "$1/rc"' _ "$job_dir" \
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
