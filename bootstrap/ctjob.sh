#!/usr/bin/env bash
# Start one job on this node, detached from the SSH session, and follow its log.
#   usage: ctjob.sh JOB_DIR --detach         start it (the job script comes on stdin); print
#                                            "::started PID"
#          ctjob.sh JOB_DIR --follow OFFSET  stream node.log from byte OFFSET; exit with the
#                                            job's exit code once it has ended
#          ctjob.sh JOB_DIR --run OFFSET     both in one session: stdin is "LENGTH\n" then the
#                                            job script (LENGTH bytes), then stays open as the
#                                            follower's EOF watch. Started once: a repeat of the
#                                            same command (a reconnect) follows from OFFSET.
# The job runs in its own session (setsid) so it can be stopped as a group; it survives the
# SSH connection dropping. Files in JOB_DIR: run.sh, node.log, pid, rc.
#
# The follower (Python, standard library: $CT_PYTHON_BIN/python3, else python3 or python on
# PATH; tail where there is none) ends as soon as the job has: the rc file is written,
# or the job's pid is gone or a zombie. (The pid is an orphan once its starter has exited; a
# PID 1 that reaps orphans late, e.g. in a container without --init, leaves it a zombie that
# 'kill -0' and 'tail --pid' take for alive.) stdout carries node.log's bytes and nothing else,
# each once: a reconnect resumes at the caller's offset. The caller keeps stdin open for the
# whole session: when the session ends (closed, dropped, or the caller killed), stdin reaches
# EOF and the follower ends with it ("::ctjob follower-stopped", 255, while the job still
# runs); the job itself keeps running. 137: the job ended without writing rc (SIGKILL).
set -u
job_dir=$1
mode=${2:-}
offset=${3:-0}
case $offset in ''|*[!0-9]*) echo "::ctjob bad-input: offset '$offset'" >&2; exit 2 ;; esac

# shellcheck disable=SC2016
follower='
import os, select, sys, time
jd, off, wait_pid = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.monotonic()
pid = None
while pid is None:
    try:
        with open(jd + "/pid") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        if time.monotonic() - t0 >= wait_pid:
            sys.stderr.write("::ctjob no-job: nothing was started in %s\n" % jd)
            sys.exit(254)
        time.sleep(0.02)

def alive():
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

def code():
    try:
        with open(jd + "/rc") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None

log = None
def drain():
    global log
    if log is None:
        try:
            log = open(jd + "/node.log", "rb")
            log.seek(off)
        except OSError:
            return False
    got = False
    while True:
        chunk = log.read(65536)
        if not chunk:
            return got
        got = True
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(1, view):]
            except BrokenPipeError:
                sys.exit(255)

watch = True
last = time.monotonic()
while True:
    if drain():
        last = time.monotonic()
        continue
    rc = code()
    if rc is None and not alive():
        rc = code()
        rc = 137 if rc is None else rc
    if rc is not None:
        drain()
        sys.exit(rc)
    delay = 0.01 if time.monotonic() - last < 1.0 else 0.1
    if not watch:
        time.sleep(delay)
    elif select.select([0], [], [], delay)[0]:
        try:
            data = os.read(0, 65536)
        except OSError:
            data = b""
        if not data:
            drain()
            rc = code()
            if rc is None and alive():
                sys.stderr.write("::ctjob follower-stopped\n")
                sys.exit(255)
            sys.exit(137 if rc is None else rc)
'
follow() {  # OFFSET WAIT_PID_SECONDS
    local py pid tail_pid watch_pid
    for py in "${CT_PYTHON_BIN:+$CT_PYTHON_BIN/python3}" "$(command -v python3)" "$(command -v python)"; do
        [ -n "$py" ] && [ -x "$py" ] && exec "$py" -S -c "$follower" "$job_dir" "$1" "$2"
    done
    # No Python on this node: tail follows the log until the job's pid has exited (late
    # where a zombie job is reaped late, see above).
    for _ in $(seq 1 $(($2 * 10))); do [ -e "$job_dir/pid" ] && break; sleep 0.1; done
    pid=$(cat "$job_dir/pid" 2>/dev/null) || pid=
    if [ -z "$pid" ]; then
        echo "::ctjob no-job: nothing was started in $job_dir" >&2
        exit 254
    fi
    tail -c +"$(($1 + 1))" -s 0.1 -F --pid="$pid" "$job_dir/node.log" 2>/dev/null &
    tail_pid=$!
    { while read -r _; do :; done; kill "$tail_pid" 2>/dev/null; } <&0 >/dev/null 2>&1 &
    watch_pid=$!
    wait "$tail_pid"
    kill "$watch_pid" 2>/dev/null
    if [ ! -e "$job_dir/rc" ] && kill -0 "$pid" 2>/dev/null; then
        echo "::ctjob follower-stopped" >&2   # the job still runs: not the job's exit
        exit 255
    fi
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        [ -r "$job_dir/rc" ] && exit "$(cat "$job_dir/rc")"
        sleep 0.1
    done
    exit 137   # ended without writing rc: killed (SIGKILL)
}

if [ "$mode" = "--follow" ]; then
    follow "$offset" 0
fi

if [ "$mode" = "--run" ]; then
    IFS= read -r len || len=
    case $len in ''|*[!0-9]*) echo "::ctjob bad-input: no script length" >&2; exit 2 ;; esac
    mkdir -p "$(dirname "$job_dir")" 2>/dev/null
    if ! mkdir "$job_dir" 2>/dev/null; then
        # Started already (this is a reconnect of the same session command): the script is
        # read and dropped, and the job followed from the caller's offset.
        head -c "$len" > /dev/null
        follow "$offset" 10
    fi
elif [ "$mode" != "--detach" ]; then
    echo "usage: ctjob.sh JOB_DIR --detach | --follow OFFSET | --run OFFSET" >&2
    exit 2
fi
# run.sh holds the task's envs (secrets): the job folder is private (0700, files 0600); the job
# itself runs with the caller's umask. Old job folders are pruned: the newest
# ${CLOUDTRAIN_KEEP_JOBS:-20} are kept, and never one whose job still runs.
job_umask=$(umask)
umask 077
mkdir -p "$job_dir" && chmod 700 "$job_dir" "$(dirname "$job_dir")"
if [ "$mode" = "--run" ]; then
    head -c "$len" > "$job_dir/run.sh"
else
    cat > "$job_dir/run.sh"
fi
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
follow "$offset" 0
