"""The training template as a sweep's trial (templates/train/train.py, docs/sweep.md "The
reporting contract"): with $CLOUDTRAIN_METRICS_FILE set, the lines of metrics.jsonl also go
there, each with its "step"; a trial ($CLOUDTRAIN_SWEEP, $CLOUDTRAIN_TRIAL) writes under
--out/sweep-NAME/trial-N, so trials sharing a node never resume each other; the sweep's
``--name_with_underscores`` arguments are the template's dashed flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import needs_torch

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "train" / "train.py"


def run(workdir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "train.py", "--max_steps", "4", "--eval_every", "2",
                           "--log-every", "2", "--num-workers", "0", "--eval-batches", "1",
                           "--ckpt-every", "0", *args],
                          cwd=workdir, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=300)


@needs_torch
def test_a_trial_reports_to_the_metrics_file_and_keeps_its_own_folder(tmp_path: Path) -> None:
    shutil.copy(TEMPLATE, tmp_path / "train.py")
    sweep_file = tmp_path / "trial-metrics.jsonl"
    env = {"CLOUDTRAIN_SWEEP": "s", "CLOUDTRAIN_TRIAL": "3",
           "CLOUDTRAIN_METRICS_FILE": str(sweep_file)}
    r = run(tmp_path, env, "--lr", "0.003")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "outputs" / "sweep-s" / "trial-3"
    mine = (out / "metrics.jsonl").read_text().splitlines()
    assert sweep_file.read_text().splitlines() == mine
    lines = [json.loads(line) for line in mine]
    assert [rec["step"] for rec in lines if "val_loss" in rec] == [0, 2, 4]
    assert all("step" in rec for rec in lines) and any("loss" in rec for rec in lines)
    assert (out / "result.json").exists() and (out / "checkpoints" / "latest").exists()

    # Another trial on the same node starts fresh in its own folder (no resume of trial 3).
    r = run(tmp_path, {**env, "CLOUDTRAIN_TRIAL": "4",
                       "CLOUDTRAIN_METRICS_FILE": str(tmp_path / "t4.jsonl")})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "outputs/sweep-s/trial-4/result.json").read_text())
    assert res["resumed_from"] is None and res["start_step"] == 0
    assert not (tmp_path / "outputs" / "metrics.jsonl").exists()


@needs_torch
def test_without_a_sweep_nothing_changes(tmp_path: Path) -> None:
    shutil.copy(TEMPLATE, tmp_path / "train.py")
    env = {k: "" for k in ("CLOUDTRAIN_SWEEP", "CLOUDTRAIN_TRIAL", "CLOUDTRAIN_METRICS_FILE")}
    r = run(tmp_path, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "outputs" / "metrics.jsonl").exists()
    assert not [p for p in (tmp_path / "outputs").iterdir() if p.name.startswith("sweep-")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", "train.py"]
