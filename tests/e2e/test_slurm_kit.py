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
