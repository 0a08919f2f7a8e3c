"""launch -d, logs, queue and cancel on provider: slurm, through the real CLI against the test
cluster: the allocation's guard starts a detached job as a step (srun) and keeps each node's
lines and exit code on the shared filesystem; ``logs`` reads them with the node's prefix,
``queue`` shows each job's Slurm step state, ``cancel`` scancels one job's step while the
other keeps running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import CLI
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]

TWO_NODES = """name: det
num_nodes: 2
max_hours: 0.25
autostop: false
resources:
  provider: slurm
  accelerators: H100:1
  slurm:
    workdir: {shared}
run: |
  echo "hello from $CLOUDTRAIN_NODE_RANK on $SLURMD_NODENAME"
  while [ ! -e {release} ]; do sleep 0.2; done
  echo "bye from $CLOUDTRAIN_NODE_RANK"
  # node 1 fails once node 0's end is recorded (else srun's --kill-on-bad-exit may end
  # node 0 before its bye: CI under load)
  rc0={shared}/.cloudtrain/jobs/$CLOUDTRAIN_JOB_ID/rc-0
  if [ "$CLOUDTRAIN_NODE_RANK" = 1 ]; then while [ ! -e $rc0 ]; do sleep 0.2; done; exit 4; fi
  exit 0
"""


def _until(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout} s: {what}")


def _job_id(out: str) -> str:
    line = next(ln for ln in out.splitlines() if "started on every node" in ln)
    return line.split("Job ", 1)[1].split()[0]


def _queue(cli: CLI, name: str) -> dict[str, dict[str, object]]:
    import json

    r = cli.run("queue", name, "--json")
    assert r.returncode == 0, r.stderr
    return {j["id"]: j for j in json.loads(r.stdout)}


def test_detached_job_runs_without_the_cli_and_logs_show_each_node(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    release = tmp_path / "release"
    f = tmp_path / "det.yaml"
    f.write_text(TWO_NODES.format(shared=tmp_path / "shared", release=release))
    r = cli.run("launch", str(f), "-y", "-d")
    assert r.returncode == 0, r.stdout + r.stderr
    job = _job_id(r.stdout + r.stderr)
    (alloc,) = [j["id"] for j in slurm.jobs()]
    # the CLI is gone; the guard srun'ed the job as a step of the allocation
    _until(lambda: _queue(cli, "det")[job]["state"] == "running", 30, "the step runs")
    q = _queue(cli, "det")[job]
    assert str(q["step"]).startswith(f"{alloc}.") and q["detached"] is True, q
    _until(lambda: "hello from 1" in cli.run("logs", "det").stdout, 30, "the first lines")
    table = cli.run("queue", "det").stdout
    assert job in table and "running" in table, table

    release.touch()
    logs = cli.run("logs", "det", "--job", job, "-f", timeout=60)    # follows to the job's end
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert sorted(ln for ln in lines if "from" in ln) == [
        "(node-0) bye from 0", "(node-0) hello from 0 on n1",
        "(node-1) bye from 1", "(node-1) hello from 1 on n2"], logs.stdout
    done = _queue(cli, "det")[job]
    assert done["state"] == "failed" and done["node_codes"] == {"0": 0, "1": 4}, done
    only1 = cli.run("logs", "det", "--node", "1").stdout
    assert "(node-1) bye from 1" in only1 and "node-0" not in only1
    # the step is Slurm's own: sacct has it, with node 1's exit code
    acct = slurm.run("sacct", "-n", "-P", "-j", alloc, "-o", "JobName,State").stdout
    assert f"ct-job-{job}|FAILED" in acct, acct
    assert [j["id"] for j in slurm.jobs()] == [alloc]          # the allocation stays
    assert cli.run("down", "det", "-y").returncode == 0
    assert slurm.jobs() == []


PACKED = """name: pk
num_nodes: 1
max_hours: 0.25
autostop: false
resources:
  provider: slurm
  accelerators: H100:2
  gpus_per_job: 1
  slurm:
    cpus_per_node: 2
    workdir: {shared}
run: |
  echo "start cvd=$CUDA_VISIBLE_DEVICES"
  while [ ! -e "$RELEASE" ]; do sleep 0.2; done
  echo released
"""


def test_cancel_stops_one_step_and_the_other_keeps_running(slurm: SlurmCluster, cli: CLI,
                                                           tmp_path: Path) -> None:
    """Two 1-GPU jobs run at once on a 2-GPU allocation and a third waits for resources;
    cancelling the waiting one means it never starts, cancelling a running one scancels its
    step while the other runs on."""
    f = tmp_path / "pk.yaml"
    f.write_text(PACKED.format(shared=tmp_path / "shared"))
    ids = []
    for k in "abc":
        r = cli.run("launch", str(f), "-y", "-d", "--env", f"RELEASE={tmp_path / k}")
        assert r.returncode == 0, r.stdout + r.stderr
        ids.append(_job_id(r.stdout + r.stderr))
    a, b, c = ids
    _until(lambda: [j["state"] for j in _queue(cli, "pk").values()].count("running") == 2, 40,
           "two steps run at once")
    (alloc,) = [j["id"] for j in slurm.jobs()]
    waiting = [i for i, j in _queue(cli, "pk").items() if j["state"] != "running"]
    assert waiting == [c] and _queue(cli, "pk")[c]["state"] == "waiting for resources"

    r = cli.run("cancel", "pk", c)
    assert r.returncode == 0 and f"Job {c} cancelled before its step started" in r.stderr, \
        r.stderr
    r = cli.run("cancel", "pk", a)
    assert r.returncode == 0, r.stderr
    assert f"Job {a} cancelled (Slurm step {alloc}." in r.stderr, r.stderr
    _until(lambda: f"ct-job-{a}" not in slurm.run("squeue", "-h", "-s", "-o", "%j").stdout,
           30, "the cancelled step is gone")
    time.sleep(4)                         # a's GPU is free: the cancelled c must not take it
    steps = slurm.run("squeue", "-h", "-s", "-o", "%j").stdout.split()
    assert [s for s in steps if s.startswith("ct-job-")] == [f"ct-job-{b}"], steps
    q = _queue(cli, "pk")
    assert (q[a]["state"], q[b]["state"], q[c]["state"]) == ("cancelled", "running",
                                                             "cancelled"), q
    assert "start cvd" not in cli.run("logs", "pk", "--job", c).stdout
    again = cli.run("cancel", "pk", a)
    assert again.returncode == 2 and "has already ended" in again.stderr

    (tmp_path / "b").touch()
    logs = cli.run("logs", "pk", "--job", b, "-f", timeout=60)
    assert "(node-0) released" in logs.stdout, logs.stdout
    assert _queue(cli, "pk")[b]["state"] == "succeeded"
    assert [j["id"] for j in slurm.jobs()] == [alloc]
    assert cli.run("down", "pk", "-y").returncode == 0
    assert slurm.jobs() == []
