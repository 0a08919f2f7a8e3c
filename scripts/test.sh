#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
#
# With no arguments: every test under tests/, spread over CLOUDTRAIN_TEST_WORKERS pytest-xdist
# workers (default 4: the suite mostly waits on real processes - sshd nodes, torchrun, the
# cloud fakes - not on the CPU). Tests that share a machine-wide resource run on one worker
# (tests/conftest.py: the network-namespace tests; modules built around one fixture). Each test
# has its own tmp_path, CLOUDTRAIN_HOME and ports. Skips are listed at the end with their
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
CLOUDTRAIN_STRICT_SKIPS=1 "${py[@]}" -n "${CLOUDTRAIN_TEST_WORKERS:-4}" --dist loadgroup \
    --basetemp="$tmp/t" --durations=15 tests
rc=$?
set -e
echo "tests: exit $rc after $(( $(date +%s) - start )) s"
exit "$rc"
