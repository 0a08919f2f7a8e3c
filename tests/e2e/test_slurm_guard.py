"""The guard inside the Slurm allocation, through the real CLI against the test cluster: it
ends its own allocation (scancel of its own job: sacct shows CANCELLED) after a --down job
even when the CLI was SIGKILLed, when no step of ours ran for the idle minutes, and when the
budget is spent; ``status --refresh`` (or ``down``) then says why."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import CLI
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]

TASK = """name: {name}
num_nodes: {nodes}
max_hours: 0.25
{autostop}
resources:
  provider: slurm
  accelerators: H100:1
  slurm:
    workdir: {shared}
    price_per_gpu_hour: {price}
{python}run: |
{run}
"""


def task(tmp_path: Path, name: str, run: str, *, nodes: int = 1, autostop: str = "autostop: false",
         price: float = 0.0, python: Path | None = None) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(TASK.format(name=name, nodes=nodes, autostop=autostop, price=price,
                             shared=tmp_path / "shared" / name,
                             python=f"    python: {python}\n" if python else "",
                             run="\n".join("  " + ln for ln in run.splitlines())))
    return f


def ended_by_guard(slurm: SlurmCluster, cli: CLI, alloc: str, name: str, timeout: float,
                   via: str = "status") -> str:
    """Wait until the allocation is gone; check sacct says CANCELLED; what status --refresh
    (or down, with ``via="down"``) says."""
    deadline = time.time() + timeout
    while any(j["id"] == alloc for j in slurm.jobs()):
        assert time.time() < deadline, f"allocation {alloc} still runs after {timeout} s"
        time.sleep(0.5)
    state = ""
    for _ in range(20):            # sacct has the end a moment after squeue lost the job
        state = slurm.run("sacct", "-X", "-n", "-P", "-j", alloc, "-o", "State").stdout.strip()
        if state and not state.startswith(("RUNNING", "PENDING")):
            break
        time.sleep(0.5)
    assert state.startswith("CANCELLED"), state
    r = cli.run("status", "--refresh") if via == "status" else cli.run("down", name, "-y")
    assert r.returncode == 0, r.stderr
    assert f"the guard ended Slurm job {alloc}" in r.stdout + r.stderr, r.stdout + r.stderr
    assert cli.run("status").stdout.strip() == "No clusters.", r.stdout + r.stderr
    return r.stdout + r.stderr


def job_step_runs(slurm: SlurmCluster, workdir: Path) -> bool:
    """Whether the step of a job handed to the guard (a request in the workdir's jobs folder)
    runs: the bootstrap's probe step also carries the 'ct-job-' prefix, and a CLI killed while
    it runs (a slow Python, a loaded machine) has not written the --down rule yet."""
    jobs = workdir / ".cloudtrain" / "jobs"
    ids = [d.name for d in jobs.iterdir() if (d / "request.json").exists()] \
        if jobs.is_dir() else []
    names = slurm.run("squeue", "-h", "-s", "-o", "%j").stdout.split()
    return any(f"ct-job-{i}" in names for i in ids)


def test_down_job_ends_the_allocation_with_the_cli_sigkilled(slurm: SlurmCluster, cli: CLI,
                                                             tmp_path: Path) -> None:
    """The CLI is SIGKILLed once the job's own step runs; the allocation's Python starts 3 s
    late (the bootstrap's probe step, also named ct-job-*, lasts that long), as on a loaded
    machine, where the kill used to come in the probe step, before the --down rule."""
    go = tmp_path / "go"
    slow = tmp_path / "slowpy"
    slow.write_text("#!/bin/sh\nsleep 3\nexec python3 \"$@\"\n")
    slow.chmod(0o755)
    f = task(tmp_path, "jobend", f'echo "job on $CLOUDTRAIN_NODE_RANK"\n'
                                 f"while [ ! -e {go} ]; do sleep 0.2; done\necho finished",
             nodes=2, python=slow)
    proc = cli.popen("launch", str(f), "-y", "-d", "--down")
    try:
        deadline = time.time() + 60
        while not any(j["name"] == "ct-jobend" and j["state"] == "RUNNING"
                      for j in slurm.jobs()):
            assert time.time() < deadline and proc.poll() in (None, 0), "no allocation"
            time.sleep(0.3)
        (alloc,) = [j["id"] for j in slurm.jobs()]
        deadline = time.time() + 60
        while not job_step_runs(slurm, tmp_path / "shared" / "jobend"):
            assert time.time() < deadline, "the guard did not start the job"
            time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)     # the laptop is gone, once the job's step runs
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(3)
    assert [j["id"] for j in slurm.jobs()] == [alloc]     # the job still runs: no stop yet
    go.touch()
    said = ended_by_guard(slurm, cli, alloc, "jobend", 60)
    assert "job-end" in said, said


def kill_guard(workdir: Path, alloc: str) -> None:
    """SIGKILL the allocation's guard (its pid from guard.log: the test cluster's own
    process); the batch script restarts it 5 s later."""
    log = (workdir / ".cloudtrain" / "slurm" / alloc / "guard.log").read_text()
    pid = int(re.findall(r"guard started on \S+ \(pid (\d+)\)", log)[-1])
    assert b"allocguard.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    os.kill(pid, signal.SIGKILL)


def test_down_job_ending_while_the_guard_restarts_still_ends_the_allocation(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """The guard dies (SIGKILL) and the --down job ends in the 5 s before the batch script
    restarts it: the restarted guard counts that job's end as this allocation's (it used to
    take its own start for the allocation's and drop the job as an earlier one's)."""
    go, workdir = tmp_path / "go", tmp_path / "shared" / "restart"
    f = task(tmp_path, "restart", f"while [ ! -e {go} ]; do sleep 0.2; done")
    r = cli.run("launch", str(f), "-y", "-d", "--down")
    assert r.returncode == 0, r.stdout + r.stderr
    (alloc,) = [j["id"] for j in slurm.jobs()]
    deadline = time.time() + 30
    while not job_step_runs(slurm, workdir):
        assert time.time() < deadline, "the guard did not start the job"
        time.sleep(0.3)
    kill_guard(workdir, alloc)
    go.touch()
    said = ended_by_guard(slurm, cli, alloc, "restart", 45)
    assert "job-end" in said, said
    log = (workdir / ".cloudtrain" / "slurm" / alloc / "guard.log").read_text()
    assert log.count("guard started on") == 2, log


def sigkilled_mid_job(slurm: SlurmCluster, cli: CLI, f: Path, started: str) -> str:
    """An attached ``launch --down`` SIGKILLed once its job printed ``started`` and the guard
    had a poll to see its step; the allocation's id."""
    proc = cli.popen("launch", str(f), "-y", "--down")
    try:
        assert proc.stdout is not None
        deadline = time.time() + 60
        while started not in proc.stdout.readline():
            assert time.time() < deadline, "the job did not start"
        (alloc,) = [j["id"] for j in slurm.jobs()]
        time.sleep(3)                             # the guard sees the step (poll 2 s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return str(alloc)


def test_attached_down_job_ends_the_allocation_when_its_cli_was_sigkilled(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """An attached launch --down killed with SIGKILL mid-job: its step runs on to its end
    (Slurm's, not the CLI's), and the guard, which saw it run, then ends the allocation."""
    go = tmp_path / "go"
    f = task(tmp_path, "attached", 'echo "started $CLOUDTRAIN_NODE_RANK"\n'
                                   f"while [ ! -e {go} ]; do sleep 0.2; done")
    alloc = sigkilled_mid_job(slurm, cli, f, "started 0")
    time.sleep(3)
    assert [j["id"] for j in slurm.jobs()] == [alloc]     # the job runs on: no stop yet
    go.touch()
    said = ended_by_guard(slurm, cli, alloc, "attached", 60)
    assert "job-end" in said, said


def test_attached_down_job_ending_while_the_guard_restarts_still_ends_the_allocation(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """An attached --down job whose CLI was SIGKILLed: the guard saw its step, then dies, and
    the step ends before the batch script restarts it. The restarted guard knows the step ran
    (it used to remember that only in memory, and waited for a step that had gone)."""
    go, workdir = tmp_path / "go", tmp_path / "shared" / "reseen"
    f = task(tmp_path, "reseen", f"echo started\nwhile [ ! -e {go} ]; do sleep 0.2; done")
    alloc = sigkilled_mid_job(slurm, cli, f, "started")
    kill_guard(workdir, alloc)
    go.touch()
    said = ended_by_guard(slurm, cli, alloc, "reseen", 45)
    assert "job-end" in said, said


def test_idle_allocation_is_ended_by_its_guard(slurm: SlurmCluster, cli: CLI,
                                               tmp_path: Path) -> None:
    f = task(tmp_path, "idle", "true", autostop="autostop:\n  idle_minutes: 0.1")
    r = cli.run("up", str(f), "-y")
    assert r.returncode == 0, r.stderr
    (alloc,) = [j["id"] for j in slurm.jobs()]
    said = ended_by_guard(slurm, cli, alloc, "idle", 45)
    assert "idle (no job step for" in said, said


def test_a_running_job_keeps_an_idle_allocation(slurm: SlurmCluster, cli: CLI,
                                                tmp_path: Path) -> None:
    """Idle counts from the last step of ours: a detached job running longer than the idle
    minutes keeps the allocation; once it ended, the idle stop comes."""
    go = tmp_path / "go"
    f = task(tmp_path, "busy", f"while [ ! -e {go} ]; do sleep 0.2; done",
             autostop="autostop:\n  idle_minutes: 0.1")
    r = cli.run("launch", str(f), "-y", "-d")
    assert r.returncode == 0, r.stderr
    (alloc,) = [j["id"] for j in slurm.jobs()]
    time.sleep(12)                                # twice the idle minutes, with the job on
    assert [j["id"] for j in slurm.jobs()] == [alloc]
    log = cli.run("logs", "busy", "--guard").stdout        # the guard's own log, via login
    assert "guard started on n1" in log and '"idle_minutes": 0.1' in log, log
    go.touch()
    said = ended_by_guard(slurm, cli, alloc, "busy", 45)
    assert "idle" in said, said


def test_budget_spent_ends_the_allocation(slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """$36 per GPU-hour x 1 GPU x 1 node is $0.01 a second: a $0.08 budget is spent in about
    8 s, and the guard scancels the allocation under the running job."""
    f = task(tmp_path, "budget", "sleep 300", price=36.0)
    r = cli.run("launch", str(f), "-y", "-d", "--max-cost", "0.08", "--hours", "0.001")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Budget in force on 'budget': budget $0.0800" in r.stderr, r.stderr
    (alloc,) = [j["id"] for j in slurm.jobs()]
    started = time.time()
    said = ended_by_guard(slurm, cli, alloc, "budget", 60, via="down")
    assert time.time() - started < 40
    assert "budget ($0.0" in said, said
