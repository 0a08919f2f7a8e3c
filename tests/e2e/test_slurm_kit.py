"""The test Slurm cluster itself (tests/slurmkit.py): two idle nodes, GPUs scheduled as
generic resources with CUDA_VISIBLE_DEVICES set, sacct answering from slurmdbd."""

from __future__ import annotations

import time

import pytest

from slurmkit import NODES, SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]


def test_two_idle_nodes(slurm: SlurmCluster) -> None:
    out = slurm.run("sinfo", "-h", "-N", "-p", "gpu", "-o", "%N %t %G").stdout.split("\n")
    assert sorted(line.split() for line in out if line) == [
        [n, "idle", "gpu:h100:2"] for n in NODES]


def test_gpu_job_gets_devices_and_sacct_shows_it(slurm: SlurmCluster) -> None:
    out = slurm.root / "gpu-job.out"
    job = slurm.run("sbatch", "--parsable", "-N", "2", "--gres=gpu:1", "-o", str(out), "--wrap",
                    "srun bash -c 'echo $SLURMD_NODENAME CVD=$CUDA_VISIBLE_DEVICES'"
                    ).stdout.strip()
    deadline = time.time() + 60
    state = ""
    while time.time() < deadline:
        state = slurm.run("sacct", "-X", "-n", "-P", "-j", job, "-o", "State,AllocTRES"
                          ).stdout.strip()
        if state.startswith("COMPLETED"):
            break
        time.sleep(0.5)
    assert state.startswith("COMPLETED|"), state + slurm.logs()
    assert "gres/gpu=2" in state                 # one GPU on each of the two nodes
    assert sorted(out.read_text().split("\n")) == ["", "n1 CVD=0", "n2 CVD=0"]


def test_two_gpus_and_a_third_is_refused(slurm: SlurmCluster) -> None:
    r = slurm.run("srun", "--gres=gpu:2", "printenv", "CUDA_VISIBLE_DEVICES")
    assert r.stdout.strip() == "0,1"
    r = slurm.run("sbatch", "--gres=gpu:3", "--wrap", "true", check=False)
    assert r.returncode != 0 and "Requested node configuration is not available" in r.stderr
    assert slurm.jobs() == []


def test_stop_leaves_nothing_running(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A second cluster with a running step (its slurmstepd and task outlive 'scontrol
    shutdown'): stop() ends every process it started or that carries its SLURM_CONF, and
    removes its folder."""
    import tempfile
    from pathlib import Path

    from conftest import processes_with

    other = SlurmCluster(Path(tempfile.mkdtemp(prefix="ct-slurm-")), name="ct2")
    try:
        other.start()
        other.run("sbatch", "-N", "2", "-o", "/dev/null", "--wrap", "srun sleep 300")
        deadline = time.time() + 30
        while time.time() < deadline and not any(
                b"slurmstepd" in Path(f"/proc/{p}/cmdline").read_bytes()
                for p in other.leftovers() if Path(f"/proc/{p}").exists()):
            time.sleep(0.3)
        assert other.leftovers(), "no step started: " + other.logs()
        daemons = [p.pid for p in other.procs.values()]
    finally:
        other.stop()
    assert other.leftovers() == []
    assert processes_with(str(other.conf)) == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in daemons)
    assert not other.root.exists()
