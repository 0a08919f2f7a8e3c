#!/usr/bin/env bash
# Wraps one torchrun worker: runs it and, when it fails, records its global rank, exit code
# and time, so cloudtrain can report the worker that failed first with its own exit code
# (torchrun itself only says 1).
"$@"
rc=$?
if [ "$rc" -ne 0 ] && [ -n "${CLOUDTRAIN_JOB_DIR:-}" ]; then
    echo "${RANK:-?} $rc $(date +%s.%N)" >> "$CLOUDTRAIN_JOB_DIR/worker-failures"
fi
exit "$rc"
