"""The ledger of a Slurm cluster comes from Slurm's own accounting, through the real CLI
against the test cluster: cost-report's GPU-hours and node-hours are what ``sacct`` says of
the allocation (read by the test itself), priced at price_per_gpu_hour; and GPUs asked for
with --gpus-per-node (resources.slurm.gpu_flag) reach the job (AllocTRES, and
CUDA_VISIBLE_DEVICES in its steps)."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest

from conftest import CLI
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, pytest.mark.e2e]

PRICE = 2.5


def task(tmp_path: Path, name: str, gpus: int, extra: str = "") -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"""name: {name}
num_nodes: 2
max_hours: 0.25
resources:
  provider: slurm
  accelerators: H100:{gpus}
  slurm:
    workdir: {tmp_path / 'shared' / name}
    price_per_gpu_hour: {PRICE}{extra}
run: echo "cvd=$CUDA_VISIBLE_DEVICES on $SLURMD_NODENAME"
""")
    return f


def sacct(slurm: SlurmCluster, job: str) -> tuple[int, int, int]:
    """(elapsed seconds, nodes, GPUs) of the allocation, as sacct has them."""
    out = slurm.run("sacct", "-X", "-n", "-P", "-j", job,
                    "-o", "ElapsedRaw,NNodes,AllocTRES").stdout.strip().splitlines()[-1]
    elapsed, nodes, tres = out.split("|")
    gpus = [int(t.split("=")[1]) for t in tres.split(",") if t.startswith("gres/gpu=")]
    return int(elapsed), int(nodes), gpus[0] if gpus else 0


def report(cli: CLI, name: str) -> dict[str, object]:
    r = cli.run("cost-report", "--json")
    assert r.returncode == 0, r.stderr
    (c,) = [c for c in json.loads(r.stdout)["clusters"] if c["name"] == name]
    return c   # type: ignore[no-any-return]


def test_ledger_gpu_hours_match_sacct(slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    assert cli.run("up", str(task(tmp_path, "acct", gpus=2)), "-y").returncode == 0
    (alloc,) = [j for j in slurm.jobs() if j["name"] == "ct-acct"]
    time.sleep(3)
    running = report(cli, "acct")           # a running allocation: sacct asked now
    assert running["scheduler_jobs"] == [alloc["id"]]
    assert running["gpu_hours"] > 0 and running["status"] == "running"

    down = cli.run("down", "acct", "-y")
    assert down.returncode == 0, down.stderr
    elapsed, nodes, gpus = sacct(slurm, alloc["id"])
    assert (nodes, gpus) == (2, 4) and elapsed >= 3
    done = report(cli, "acct")
    assert done["gpu_hours"] == pytest.approx(elapsed * gpus / 3600, abs=1e-6)
    assert done["node_hours"] == pytest.approx(elapsed * nodes / 3600, abs=1e-6)
    assert done["cost_usd"] == pytest.approx(elapsed * gpus / 3600 * PRICE, abs=1e-5)
    assert done["gpu_hours"] >= running["gpu_hours"]
    rows = {r["name"]: r for r in csv.DictReader(io.StringIO(
        cli.run("cost-report", "--csv").stdout))}
    assert float(rows["acct"]["gpu_hours"]) == pytest.approx(elapsed * gpus / 3600, abs=1e-6)
    assert float(rows["acct"]["node_hours"]) == pytest.approx(elapsed * nodes / 3600, abs=1e-6)
    table = cli.run("cost-report")
    assert f"from sacct (Slurm job(s) {alloc['id']})" in table.stdout, table.stdout
    assert "GPU-hour(s)" in table.stdout and "node-hour(s)" in table.stdout


def test_gpus_per_node_reaches_the_job(slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    f = task(tmp_path, "gpn", gpus=2, extra="\n    gpu_flag: gpus-per-node")
    plan = cli.run("up", str(f), "--dry-run")
    assert "--gpus-per-node=2" in plan.stdout + plan.stderr and "--gres" not in plan.stdout
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 0, r.stderr
    (alloc,) = [j for j in slurm.jobs() if j["name"] == "ct-gpn"]
    shown = slurm.run("scontrol", "show", "job", alloc["id"]).stdout
    assert "TresPerNode=gres:gpu:2" in shown, shown
    assert sorted(ln for ln in r.stdout.splitlines() if "cvd=" in ln) == [
        "(node-0) cvd=0,1 on n1", "(node-1) cvd=0,1 on n2"]
    assert cli.run("down", "gpn", "-y").returncode == 0
    assert slurm.jobs() == []
    assert sacct(slurm, alloc["id"])[2] == 4      # 2 nodes x 2 GPUs, as Slurm accounted them
    assert report(cli, "gpn")["gpu_hours"] > 0
