#!/usr/bin/env bash
# Wraps one torchrun worker: runs it and, when it fails, records its global rank, exit code
# and time, so cloudtrain can report the worker that failed first with its own exit code
# (torchrun itself only says 1), and its local rank.
"$@"
rc=$?
if [ "$rc" -ne 0 ] && [ -n "${CLOUDTRAIN_JOB_DIR:-}" ]; then
    echo "${RANK:-?} $rc $(date +%s.%N) ${LOCAL_RANK:-?}" >> "$CLOUDTRAIN_JOB_DIR/worker-failures"
    echo "::ctworker exit $rc" >&2   # in this rank's own stream: the CLI stops echoing others
fi
exit "$rc"
