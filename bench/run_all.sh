#!/usr/bin/env bash
# Run the cloudtrain benchmarks one after the other, each with its own temporary
# CLOUDTRAIN_HOME (each script tears its clusters down itself, also on Ctrl-C).
#
#   bench/run_all.sh                     # defaults (launch: 1,4,8,16 nodes x 5 warm launches)
#   NODES=1,4 REPEATS=3 bench/run_all.sh # quicker
#   PYTHON=/path/to/python bench/run_all.sh
#   SWEEP_NODES=1,2 bench/run_all.sh     # the sweep bench on 1 and 2 nodes (default 2)
#
# Exit status: non-zero only when a script crashed (targets missed still exit 0).
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python}"
nodes="${NODES:-1,4,8,16}"
repeats="${REPEATS:-5}"
sync_nodes="${SYNC_NODES:-1}"
status=0

run() {
    echo
    echo "================================================================================"
    echo "== $*"
    echo "================================================================================"
    "$@" || { rc=$?; echo "!! '$*' exited $rc"; status=1; [ "$rc" -eq 130 ] && exit 130; }
}

run "$py" "$here/bench_cli_start.py" -n 20
run "$py" "$here/bench_launch_overhead.py" --nodes "$nodes" --repeats "$repeats"
run "$py" "$here/bench_sync.py" --nodes "$sync_nodes" --repeats "$repeats"
run "$py" "$here/bench_cost.py" -n 200 -m 10
run "$py" "$here/bench_commands.py"
run "$py" "$here/bench_ssh.py"
run "$py" "$here/bench_template.py" --nprocs 1,2
run "$py" "$here/bench_aws.py"
run "$py" "$here/bench_sweep.py" --nodes "${SWEEP_NODES:-2}"
exit $status
