"""Recovery with the training template (issue 13): 2 local nodes train with gloo; mid-run the
local "cloud" takes node 1 (its sshd and every process under it are killed). ``launch
--recover`` replaces it and the template resumes from the newest checkpoint node 0 kept: the
run ends at the same step, at the same place in the data order and with the same losses as
an uninterrupted run of the same task."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from cloud_storage_helpers import losses as _losses
from conftest import CLI, needs_sshd, needs_torch, processes_with, wait_until

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

ARGS = ["--max-steps", "40", "--ckpt-every", "5", "--batch-size", "16", "--eval-every", "10",
        "--log-every", "1", "--num-workers", "0", "--warmup-steps", "3", "--patience", "0",
        "--sleep-per-step", "0.2"]


def _project(cli: CLI, d: Path, name: str) -> Path:
    r = cli.run("init", str(d))
    assert r.returncode == 0, r.stderr
    p = d / f"{name}.yaml"
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources:\n  provider: local\nworkdir: .\n"
                 "envs:\n  OMP_NUM_THREADS: '1'\nstop_grace: 5\n"
                 "recovery: {poll_seconds: 1, max_recoveries: 1}\n"
                 "train:\n  script: train.py\n  nproc_per_node: 1\n"
                 f"  args: {json.dumps(ARGS)}\noutputs: [outputs/]\n")
    return p


def _steps_on_node0(cli: CLI, name: str) -> int:
    f = (cli.home / "clusters" / name / "local" / "nodes" / "0" / "root" / "workdir" / "outputs"
         / "metrics.jsonl")
    try:
        return sum(1 for ln in f.read_text().splitlines() if '"loss"' in ln)
    except OSError:
        return 0


def test_template_resumes_after_a_lost_node_like_an_uninterrupted_run(
        cli: CLI, tmp_path: Path) -> None:
    ref_task = _project(cli, tmp_path / "ref", "tref")
    r = cli.run("launch", str(ref_task), "-y", "--recover", "--down", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref = json.loads((tmp_path / "ref" / "cloudtrain-outputs" / "outputs" / "result.json")
                     .read_text())
    assert ref["final_step"] == 40 and ref["start_step"] == 0

    task = _project(cli, tmp_path / "rec", "trec")
    proc = cli.popen("launch", str(task), "-y", "--recover", "--down",
                     CLOUDTRAIN_NODE_TIMEOUT="20")
    assert wait_until(lambda: _steps_on_node0(cli, "trec") >= 12, 300), "the job did not train"
    node1 = cli.home / "clusters" / "trec" / "local" / "nodes" / "1"
    for p in [int((node1 / "sshd.pid").read_text())] + processes_with(f"HOME={node1 / 'root'}"):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "the cloud took node 1" in out + err
    got = json.loads((tmp_path / "rec" / "cloudtrain-outputs" / "outputs" / "result.json")
                     .read_text())
    assert got["start_step"] >= 10 and got["resumed_from"], got     # resumed, not restarted
    assert got["final_step"] == ref["final_step"]
    assert got["final_position"] == ref["final_position"]           # same place in the data
    a, b = _losses(tmp_path / "ref"), _losses(tmp_path / "rec")
    assert len(a) == 40 and sorted(a) == sorted(b), (a, b)
    print('start_step', got['start_step'], 'losses', a[max(a)], b[max(b)])
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (step, a[step], b[step])
