"""launch on provider: slurm through the real CLI against the test cluster: the job runs as a
step of the cluster's allocation (srun, one task a node) with the cluster variables and the
synced workdir, each node's lines carry its rank, a failing rank is named with its exit code,
--down ends the allocation after the job, and what is not built yet exits 2 creating
nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import CLI, needs_torch
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]

JOB = """name: steps
num_nodes: 2
max_hours: 0.25
workdir: .
envs:
  GREETING: hello
resources:
  provider: slurm
  accelerators: H100:1
  slurm:
    workdir: {shared}
{extra}
"""
RUN = """run: |
  echo "$GREETING rank=$CLOUDTRAIN_NODE_RANK/$CLOUDTRAIN_NUM_NODES on $SLURMD_NODENAME \\
  cvd=$CUDA_VISIBLE_DEVICES head=$MASTER_ADDR job=$SLURM_JOB_ID $(cat data.txt)"
  if [ -n "$FAIL" ] && [ "$CLOUDTRAIN_NODE_RANK" = 1 ]; then echo "rank 1 breaks" >&2; exit 3; fi
"""


def project(tmp_path: Path, extra: str = RUN) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "data.txt").write_text("data-synced\n")
    f = proj / "job.yaml"
    f.write_text(JOB.format(shared=tmp_path / "shared" / "steps", extra=extra))
    return f


def test_job_runs_as_a_step_on_every_node_then_down(slurm: SlurmCluster, cli: CLI,
                                                    tmp_path: Path) -> None:
    f = project(tmp_path)
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 0, r.stderr
    (alloc,) = [j for j in slurm.jobs() if j["name"] == "ct-steps"]
    lines = sorted(ln for ln in r.stdout.splitlines() if "hello" in ln)
    assert lines == [
        f"(node-0) hello rank=0/2 on n1 cvd=0 head=127.0.0.1 job={alloc['id']} data-synced",
        f"(node-1) hello rank=1/2 on n2 cvd=0 head=127.0.0.1 job={alloc['id']} data-synced"]
    assert "succeeded on every node" in r.stderr

    failed = cli.run("launch", str(f), "--env", "FAIL=1")
    assert failed.returncode == 3, failed.stderr
    # (then "; node 0 ended after it" when srun ended node 0, still running, for node 1)
    assert "failed on node 1 (exit code 3" in failed.stderr
    assert "(node-1) rank 1 breaks" in failed.stdout
    assert [j["id"] for j in slurm.jobs()] == [alloc["id"]]      # the allocation stays

    for cmd in (("ssh", "steps"),):   # nodes are reached through Slurm, not over SSH
        r = cli.run(*cmd)
        assert r.returncode == 2 and "reached through the scheduler, not over SSH" in r.stderr, \
            (cmd, r.stderr)
    last = cli.run("launch", str(f), "--down")
    assert last.returncode == 0, last.stderr
    assert "'steps' is down" in last.stderr
    assert slurm.jobs() == []
    acct = slurm.run("sacct", "-n", "-P", "-j", alloc["id"], "-o", "JobID,State,ExitCode").stdout
    steps = [ln.split("|") for ln in acct.splitlines() if ln.split("|")[0][-2:-1] == "."]
    assert [(s[0], s[1], s[2]) for s in steps] == [     # .0: bootstrap's check step
        (f"{alloc['id']}.0", "COMPLETED", "0:0"), (f"{alloc['id']}.1", "COMPLETED", "0:0"),
        (f"{alloc['id']}.2", "FAILED", "3:0"), (f"{alloc['id']}.3", "COMPLETED", "0:0")], acct


DDP = """import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
# One write per line: two workers of a node share srun's output, and python -u's print
# writes its text and its newline apart (docs/slurm.md).
sys.stdout.write(f"rank {dist.get_rank()}/{dist.get_world_size()} node "
                 f"{os.environ['CLOUDTRAIN_NODE_RANK']} local {os.environ['LOCAL_RANK']} "
                 f"sum {t.item():g}\\n")
dist.destroy_process_group()
"""


@needs_torch
def test_train_is_one_torchrun_per_node_ranked_by_slurm(slurm: SlurmCluster, cli: CLI,
                                                        tmp_path: Path) -> None:
    """A 2-node x 2-process DDP job (gloo): torchrun's --node-rank is Slurm's SLURM_NODEID."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "ddp.py").write_text(DDP)
    f = proj / "job.yaml"
    f.write_text(JOB.format(shared=tmp_path / "shared", extra="").replace(
        "resources:", "resources:").replace(
        "    workdir:", f"    python: {sys.executable}\n    workdir:")
        + "train:\n  script: ddp.py\n  nproc_per_node: 2\n")
    r = cli.run("launch", str(f), "-y", "--down", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = sorted(ln.split(") ", 1)[1] for ln in r.stdout.splitlines() if " sum " in ln)
    assert ranks == [f"rank {g}/4 node {g // 2} local {g % 2} sum 6" for g in range(4)], r.stdout
    assert slurm.jobs() == []


@pytest.mark.parametrize("extra, flags, words", [
    (RUN, ("--recover",), "launch --recover is not built yet"),
])
def test_what_is_not_built_exits_2_creating_nothing(slurm: SlurmCluster, cli: CLI,
                                                    tmp_path: Path, extra: str,
                                                    flags: tuple[str, ...], words: str) -> None:
    f = project(tmp_path, extra)
    r = cli.run("launch", str(f), "-y", *flags)
    assert r.returncode == 2, r.stderr
    assert words in r.stderr
    assert slurm.jobs() == []
    assert cli.run("status").stdout.strip() == "No clusters."


def test_ctrl_c_cancels_the_step_and_keeps_the_allocation(slurm: SlurmCluster, cli: CLI,
                                                          tmp_path: Path) -> None:
    import signal
    import time

    f = project(tmp_path, 'run: |\n  echo "started $CLOUDTRAIN_NODE_RANK"\n  sleep 300\n')
    proc = cli.popen("launch", str(f), "-y")
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.time() + 60
        while seen.count("started") < 2 and time.time() < deadline:
            seen += proc.stdout.readline()
        assert seen.count("started") == 2, seen
        (alloc,) = [j["id"] for j in slurm.jobs()]
        steps = slurm.run("squeue", "-h", "-s", "-j", alloc, "-o", "%i %j").stdout
        assert "ct-job-" in steps, steps
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    deadline = time.time() + 30
    while "ct-job-" in slurm.run("squeue", "-h", "-s", "-j", alloc, "-o", "%j").stdout \
            and time.time() < deadline:
        time.sleep(0.5)
    assert "ct-job-" not in slurm.run("squeue", "-h", "-s", "-j", alloc, "-o", "%j").stdout
    assert [j["id"] for j in slurm.jobs()] == [alloc]     # the allocation is still held
    assert cli.run("down", "steps", "-y").returncode == 0
    assert slurm.jobs() == []


def test_what_is_never_sent(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The workdir sync leaves out .git and cloudtrain's own home (its keys and state) when
    that lies inside the workdir, as on every provider."""
    f = project(tmp_path)
    proj = f.parent
    (proj / ".git").mkdir()
    (proj / ".git" / "config").write_text("[core]\n")
    home = proj / "cthome"
    home.mkdir()
    inner = CLI(home)
    r = inner.run("launch", str(f), "-y", "--down")
    assert r.returncode == 0, r.stderr
    shared = tmp_path / "shared" / "steps"
    assert (shared / "data.txt").read_text() == "data-synced\n"
    assert not (shared / ".git").exists() and not (shared / "cthome").exists()
    assert slurm.jobs() == []


PACKED = """name: packed
num_nodes: 1
max_hours: 0.25
resources:
  provider: slurm
  accelerators: H100:2
  gpus_per_job: 1
  slurm:
    cpus_per_node: 2
    workdir: {shared}
run: |
  echo "start cvd=$CUDA_VISIBLE_DEVICES gpus=$CLOUDTRAIN_GPUS_PER_NODE"
  while [ ! -e "$RELEASE" ]; do sleep 0.2; done
"""


def test_one_gpu_jobs_pack_two_at_once_and_a_third_waits(slurm: SlurmCluster, cli: CLI,
                                                         tmp_path: Path) -> None:
    """An allocation of one node with 2 GPUs: two 1-GPU jobs run at once as steps (GPU 0 and
    GPU 1), a third waits until one of them ends, then gets its GPU."""
    import time

    f = tmp_path / "packed.yaml"
    f.write_text(PACKED.format(shared=tmp_path / "shared"))
    release = {k: tmp_path / f"release-{k}" for k in "abc"}
    procs = {}

    def started(k: str, timeout: float) -> str:
        deadline = time.time() + timeout
        p = procs[k]
        while time.time() < deadline:
            line = p.stdout.readline()
            if "start cvd=" in line:
                assert "gpus=1" in line, line                   # the job's share of the node
                return line.split("cvd=")[1].split()[0]
        return ""

    try:
        procs["a"] = cli.popen("launch", str(f), "-y", "--env", f"RELEASE={release['a']}")
        a = started("a", 60)
        procs["b"] = cli.popen("launch", str(f), "--env", f"RELEASE={release['b']}")
        b = started("b", 60)
        assert sorted([a, b]) == ["0", "1"]                     # both at once, one GPU each
        procs["c"] = cli.popen("launch", str(f), "--env", f"RELEASE={release['c']}")
        time.sleep(8)
        (alloc,) = [j["id"] for j in slurm.jobs()]
        steps = slurm.run("squeue", "-h", "-s", "-j", alloc, "-o", "%j").stdout.split()
        assert len([s for s in steps if s.startswith("ct-job-")]) == 2, steps
        import select
        waiting = procs["c"].stdout
        assert not select.select([waiting], [], [], 0)[0] or "start" not in waiting.readline()
        release["a"].touch()                                    # a ends: c gets its GPU
        assert procs["a"].wait(60) == 0
        assert started("c", 60) == a
        release["b"].touch()
        release["c"].touch()
        assert procs["b"].wait(60) == 0 and procs["c"].wait(60) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert cli.run("down", "packed", "-y").returncode == 0
    assert slurm.jobs() == []
