"""provider: slurm through the real CLI against the test Slurm cluster (tests/slurmkit.py),
the login node reached 'local': a cluster is one allocation job; up waits for it (showing
Slurm's pending reason) and ends once it runs, Ctrl-C while pending cancels it, status shows
the job id, state and time left, down leaves no job in squeue, and the site's refusals exit 2
in Slurm's own words with nothing queued."""

from __future__ import annotations

import json
import select
import signal
import time
from pathlib import Path

import pytest

from conftest import CLI
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]


def task(tmp_path: Path, name: str = "alloc", num_nodes: int = 2, gpus: int = 1,
         max_hours: float = 0.5, **slurm_opts: object) -> Path:
    opts = "".join(f"\n    {k}: {json.dumps(v)}" for k, v in slurm_opts.items())
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"""name: {name}
num_nodes: {num_nodes}
max_hours: {max_hours}
resources:
  provider: slurm
  accelerators: H100:{gpus}
  slurm:
    login: local
    price_per_gpu_hour: 2.0{opts}
run: echo "hello from $SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES"
""")
    return f


def occupy(slurm: SlurmCluster) -> str:
    """A job of someone else's holding every GPU of both nodes."""
    job = slurm.run("sbatch", "--parsable", "-J", "other-user", "-N", "2", "--gres=gpu:2",
                    "-t", "10", "-o", "/dev/null", "--wrap", "sleep 600").stdout.strip()
    deadline = time.time() + 30
    while time.time() < deadline:
        if any(j["id"] == job and j["state"] == "RUNNING" for j in slurm.jobs()):
            return job
        time.sleep(0.3)
    raise AssertionError(f"the occupying job did not start: {slurm.jobs()}")


def read_until(proc, needle: str, timeout: float) -> str:  # type: ignore[no-untyped-def]
    """stderr of ``proc`` until a line holds ``needle`` (all of it, for the message)."""
    seen = ""
    deadline = time.time() + timeout
    while time.time() < deadline and needle not in seen:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if ready:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen += line
    assert needle in seen, seen
    return seen


def ours(slurm: SlurmCluster) -> list[dict[str, str]]:
    return [j for j in slurm.jobs() if j["name"].startswith("ct-")]


def test_up_pends_with_the_reason_then_runs_status_and_down(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    other = occupy(slurm)
    proc = cli.popen("up", str(task(tmp_path)), "-y")
    try:
        seen = read_until(proc, "PENDING (Resources)", 60)
        assert "Slurm job" in seen
        (alloc,) = ours(slurm)
        assert alloc["state"] == "PENDING" and alloc["name"] == "ct-alloc"
        slurm.run("scancel", other)                 # the nodes free up: the allocation starts
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, seen + err
    assert f"Slurm job {alloc['id']} RUNNING on n[1-2]" in err
    assert "Cluster 'alloc' is up: 2 node(s) on slurm" in err
    (running,) = ours(slurm)
    assert running["id"] == alloc["id"] and running["state"] == "RUNNING"

    st = cli.run("status", "--refresh")         # asks Slurm (a plain status asks no one)
    assert st.returncode == 0, st.stderr
    line = next(ln for ln in st.stdout.splitlines() if ln.startswith("alloc: Slurm job"))
    assert f"Slurm job {alloc['id']} RUNNING on n[1-2], time left 2" in line   # 29:5x of 30:00
    (row,) = cli.status()
    assert [(n["rank"], n["host"]) for n in row["nodes"]] == [(0, "n1"), (1, "n2")]  # type: ignore[index]
    assert row["price_hourly_usd"] == 2.0                     # one GPU a node at $2/GPU-hour
    assert {n["host_key"] for n in row["nodes"]} == {          # type: ignore[index]
        "none: the nodes are reached through Slurm, not SSH"}

    # up again adopts the running allocation: nothing new is queued
    again = cli.run("up", str(task(tmp_path)), "-y")
    assert again.returncode == 0, again.stderr
    assert [j["id"] for j in ours(slurm)] == [alloc["id"]]

    down = cli.run("down", "alloc", "-y")
    assert down.returncode == 0, down.stderr
    assert "'alloc' is down" in down.stderr
    assert ours(slurm) == []
    acct = slurm.run("sacct", "-X", "-n", "-P", "-j", alloc["id"], "-o", "State").stdout
    assert acct.startswith("CANCELLED"), acct
    assert cli.run("status").stdout.strip() == "No clusters."


def test_ctrl_c_while_pending_cancels_the_allocation(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    occupy(slurm)
    proc = cli.popen("up", str(task(tmp_path, name="waiting")), "-y")
    try:
        read_until(proc, "PENDING (Resources)", 60)
        assert [j["state"] for j in ours(slurm)] == ["PENDING"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "cancelled Slurm job" in err
    assert ours(slurm) == []
    assert cli.run("status").stdout.strip() == "No clusters."


@pytest.mark.parametrize("shape, words", [
    ({"partition": "nope"}, "Invalid partition name specified"),
    ({"account": "nope"}, "Invalid account or account/partition combination specified"),
    ({"num_nodes": 3}, "Node count specification invalid"),
    ({"gpus": 3}, "Requested node configuration is not available"),
    ({"max_hours": 2}, "Requested time limit is invalid"),
    ({"gpu_type": "H100"}, "Requested node configuration is not available"),  # case matters
    ({"qos": "nope"}, "Invalid qos specification"),
])
def test_site_refusals_exit_2_in_slurms_words_and_leave_nothing(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path, shape: dict[str, object],
        words: str) -> None:
    r = cli.run("up", str(task(tmp_path, **shape)), "-y")  # type: ignore[arg-type]
    assert r.returncode == 2, r.stderr
    assert "Slurm refused the allocation" in r.stderr and words in r.stderr
    assert "Traceback" not in r.stderr
    assert slurm.jobs() == []
    assert cli.run("status").stdout.strip() == "No clusters."


def test_options_the_site_accepts(slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """account, partition and the site's GPU type name reach sbatch (scontrol shows them)."""
    f = task(tmp_path, name="lab", num_nodes=1, gpus=2, account="ctlab", partition="small",
             gpu_type="h100", workdir=str(tmp_path / "shared"))
    r = cli.run("up", str(f), "-y")
    assert r.returncode == 0, r.stderr
    (job,) = ours(slurm)
    assert job["nodes"] == "n1"
    shown = slurm.run("scontrol", "-o", "show", "job", job["id"]).stdout.split()
    for field in ("Account=ctlab", "Partition=small", "TimeLimit=00:30:00", "NumNodes=1"):
        assert field in shown, shown
    assert "gres/gpu=2" in next(f for f in shown if f.startswith("TRES="))
    launch = cli.run("launch", str(f))           # a step of it: on n1, with both GPUs
    assert launch.returncode == 0, launch.stderr
    assert "(node-0) hello from n1 cvd=0,1" in launch.stdout, launch.stdout
    assert [j["id"] for j in ours(slurm)] == [job["id"]]
    assert cli.run("down", "lab", "-y").returncode == 0
    assert ours(slurm) == []


def test_a_job_the_site_would_queue_forever_is_cancelled_and_exits_2(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """30 minutes under a QOS allowing 10: Slurm accepts the job but never starts it
    (QOSMaxWallDurationPerJobLimit); up cancels it and says why."""
    r = cli.run("up", str(task(tmp_path, qos="short", max_hours=0.5)), "-y")
    assert r.returncode == 2, r.stderr
    assert "Slurm will never start this allocation: QOSMaxWallDurationPerJobLimit" in r.stderr
    assert "Traceback" not in r.stderr
    assert slurm.jobs() == []
    assert cli.run("status").stdout.strip() == "No clusters."
    ok = cli.run("up", str(task(tmp_path, qos="short", max_hours=0.1)), "-y")   # 6 minutes
    assert ok.returncode == 0, ok.stderr
    assert cli.run("down", "alloc", "-y").returncode == 0


def test_the_time_limit_ends_the_allocation_with_nothing_of_ours_running(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    """max_hours is the allocation's time limit: slurmctld ends it by itself (about a minute
    and a half here: the 1-minute limit, then Slurm's own checks); status --refresh says so,
    and the next launch submits a new allocation."""
    f = task(tmp_path, name="brief", max_hours=0.0166, workdir=str(tmp_path / "shared"))
    r = cli.run("up", str(f), "-y")
    assert r.returncode == 0, r.stderr
    (job,) = ours(slurm)
    assert "TimeLimit=00:01:00" in slurm.run("scontrol", "-o", "show", "job", job["id"]).stdout
    deadline = time.time() + 180
    while ours(slurm) and time.time() < deadline:
        time.sleep(2)
    assert ours(slurm) == []
    acct = slurm.run("sacct", "-X", "-n", "-P", "-j", job["id"], "-o", "State").stdout
    assert acct.strip() == "TIMEOUT", acct
    st = cli.run("status", "--refresh")
    assert "brief: no allocation in the scheduler" in st.stdout, st.stdout
    again = cli.run("launch", str(f))
    assert again.returncode == 0, again.stderr
    (new,) = ours(slurm)
    assert new["id"] != job["id"] and "hello" in again.stdout
    assert cli.run("down", "brief", "-y").returncode == 0
