#!/usr/bin/env bash
# Start one job on this node, detached from the SSH session, and (unless --detach) stream its
# log until it ends, exiting with its exit code.
#   usage: ctjob.sh JOB_DIR [--detach]      (the job script comes on stdin)
#          ctjob.sh JOB_DIR --follow OFFSET (stream node.log from byte OFFSET; exit with the
#                                            job's exit code once it has ended)
# The job runs in its own session (setsid) so it can be stopped as a group; it survives the
# SSH connection dropping. Files in JOB_DIR: run.sh, node.log, pid, rc.
set -u
job_dir=$1
mode=${2:-}
if [ "$mode" = "--follow" ]; then
    # Follow a job started earlier, from the byte the caller already has (a reconnect resumes
    # here: nothing lost, nothing repeated). stdout carries node.log's bytes and nothing else.
    # The caller keeps stdin open for the whole session: when the session ends (closed,
    # dropped, or the caller killed), stdin reaches EOF and the follower ends with it; the job
    # itself keeps running.
    offset=${3:-0}
    pid=$(cat "$job_dir/pid" 2>/dev/null) || pid=
    if [ -z "$pid" ]; then
        echo "::ctjob no-job: nothing was started in $job_dir" >&2
        exit 254
    fi
    tail -c +"$((offset + 1))" -s 0.1 -F --pid="$pid" "$job_dir/node.log" 2>/dev/null &
    tail_pid=$!
    { while read -r _; do :; done; kill "$tail_pid" 2>/dev/null; } <&0 >/dev/null 2>&1 &
    watch_pid=$!
    wait "$tail_pid"
    kill "$watch_pid" 2>/dev/null
    if kill -0 "$pid" 2>/dev/null; then
        echo "::ctjob follower-stopped" >&2   # the job still runs: not the job's exit
        exit 255
    fi
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        [ -r "$job_dir/rc" ] && exit "$(cat "$job_dir/rc")"
        sleep 0.1
    done
    exit 137   # ended without writing rc: killed (SIGKILL)
fi
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
