#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
#
# With no arguments: every test under tests/, spread over CLOUDTRAIN_TEST_WORKERS pytest-xdist
# workers (default 4: the suite mostly waits on real processes - sshd nodes, torchrun, the
# cloud fakes - not on the CPU), one test file per worker at a time (--dist loadfile): a
# file's tests share its module fixtures, and the network-namespace tests, which compare the
# host's ct-* objects before and after, all live in one file. (--dist loadgroup would group
# finer, but with pytest 9.2 and xdist 3.8 it does not group at all.) Each test has its own
# tmp_path, CLOUDTRAIN_HOME and ports. Skips are listed at the end with their
# reasons, and a skip whose reason is not true here fails the run (tests/skipcheck.py).
# With arguments, one pytest runs with them, as given (no workers unless you pass -n).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
py=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ "$#" -gt 0 ]; then
    exec "${py[@]}" "$@"
fi
tmp=$(mktemp -d /tmp/ctt.XXXXXX)   # short: some tests put sockets under their tmp_path
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
set +e
CLOUDTRAIN_STRICT_SKIPS=1 "${py[@]}" -n "${CLOUDTRAIN_TEST_WORKERS:-4}" --dist loadfile \
    --basetemp="$tmp/t" --durations=15 tests
rc=$?
set -e
echo "tests: exit $rc after $(( $(date +%s) - start )) s"
exit "$rc"
