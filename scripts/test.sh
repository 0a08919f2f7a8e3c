#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
#
# With no arguments the suite runs as two pytest processes at once: tests/e2e (real sshd
# nodes; most of their time is spent waiting on processes, not on the CPU) and everything
# else (the cloud fakes, then the unit tests). Each has its own --basetemp; their output is
# streamed with a prefix and the run fails when either fails. With arguments, one pytest
# runs with them, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
py=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ "$#" -gt 0 ]; then
    exec "${py[@]}" "$@"
fi
tmp=$(mktemp -d /tmp/ctt.XXXXXX)   # short: some tests put sockets under their tmp_path
part() {   # part NAME ARGS...: one pytest, its output prefixed, its exit code in tmp/NAME.rc
    local name=$1; shift
    set +e
    "${py[@]}" --basetemp="$tmp/$name" "$@" 2>&1 | sed -u "s/^/[$name] /"
    echo "${PIPESTATUS[0]}" > "$tmp/$name.rc"
}
start=$(date +%s)
part e2e tests/e2e &
e2e=$!
part rest tests --ignore=tests/e2e &
rest=$!
wait "$e2e" "$rest"
rc_e2e=$(cat "$tmp/e2e.rc"); rc_rest=$(cat "$tmp/rest.rc")
echo "tests: e2e exit $rc_e2e, the rest exit $rc_rest, $(( $(date +%s) - start )) s in all"
rm -rf "$tmp"
[ "$rc_e2e" = 0 ] && [ "$rc_rest" = 0 ]
