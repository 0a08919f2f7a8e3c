"""``cloudtrain exec`` on a Slurm cluster through the real CLI against the test cluster: the
command runs as a step of the allocation (srun --overlap), on every node or one, in the
workdir with the cluster variables and the last launch's envs, each line with its node's
rank, the exit code propagated; it runs beside a job that holds the nodes; ssh stays
refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import CLI
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]


def task(tmp_path: Path, run: str) -> Path:
    f = tmp_path / "ex.yaml"
    f.write_text(f"""name: ex
num_nodes: 2
max_hours: 0.25
envs:
  GREETING: hello
resources:
  provider: slurm
  accelerators: H100:1
  slurm:
    workdir: {tmp_path / 'shared'}
run: {run}
""")
    return f


def test_exec_runs_as_a_step_of_the_allocation(slurm: SlurmCluster, cli: CLI,
                                               tmp_path: Path) -> None:
    assert cli.run("launch", str(task(tmp_path, "echo ok")), "-y").returncode == 0
    (alloc,) = [j for j in slurm.jobs() if j["name"] == "ct-ex"]
    r = cli.run("exec", "ex", "--", 'echo "$GREETING rank=$CLOUDTRAIN_NODE_RANK/'
                '$CLOUDTRAIN_NUM_NODES on $SLURMD_NODENAME job=$SLURM_JOB_ID in $PWD"')
    assert r.returncode == 0, r.stderr
    wd = tmp_path / "shared"
    assert sorted(ln for ln in r.stdout.splitlines() if "hello" in ln) == [
        f"(node-0) hello rank=0/2 on n1 job={alloc['id']} in {wd}",
        f"(node-1) hello rank=1/2 on n2 job={alloc['id']} in {wd}"]

    one = cli.run("exec", "ex", "--node", "1", "--", "echo on $SLURMD_NODENAME; exit 7")
    assert one.returncode == 7, one.stderr
    assert "(node-1) on n2" in one.stdout and "n1" not in one.stdout
    assert "exited with code 7 on node 1" in one.stderr

    both = cli.run("exec", "ex", "--", '[ "$CLOUDTRAIN_NODE_RANK" = 1 ] && exit 5; sleep 1; '
                   'echo survived')          # a failing node does not end the others' command
    assert both.returncode == 5, both.stderr
    assert "(node-0) survived" in both.stdout and "exited with code 5 on node 1" in both.stderr

    # a job holding the allocation's GPUs: exec runs beside it rather than waiting
    busy = cli.popen("launch", str(task(tmp_path, "sleep 60")))
    try:
        deadline = time.time() + 30
        while time.time() < deadline and "ct-job-" not in slurm.run(
                "squeue", "-h", "-s", "-o", "%j").stdout:
            time.sleep(0.3)
        assert "ct-job-" in slurm.run("squeue", "-h", "-s", "-o", "%j").stdout   # it holds them
        t0 = time.time()
        side = cli.run("exec", "ex", "--", "echo beside", timeout=60)
        assert side.returncode == 0, side.stderr
        assert sorted(side.stdout.split("\n"))[-2:] == ["(node-0) beside", "(node-1) beside"]
        assert time.time() - t0 < 30
    finally:
        busy.terminate()
        busy.wait(60)
    assert cli.run("ssh", "ex").returncode == 2
    assert cli.run("down", "ex", "-y").returncode == 0
    assert slurm.jobs() == []
