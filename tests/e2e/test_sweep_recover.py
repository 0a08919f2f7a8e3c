"""``cloudtrain sweep SWEEP.yaml --recover`` through the real CLI (docs/sweep.md, "Resuming
after the head is lost"): a sweep on a local node with 2 GPU slots whose task keeps its
checkpoints in moto's S3 server. Mid-sweep the local "cloud" takes the head (its sshd and
every process under it die, and with its folder the study's journal); the controller replaces
it, the driver starts on the new head from the journal kept in the bucket, tells the trials
the lost head ran FAIL (``lost``), and runs the sweep to its total: every trial accounted for,
then the cluster goes down (``down: true``) and ``sweep results`` answers from the ledger.
Without ``checkpoints:``, ``--recover`` is refused with exit 2 and nothing is created."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import storage_emulators as emus
from conftest import CLI, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]

TRIALS = 8

TASK = {
    "name": "rsw", "num_nodes": 1, "stop_grace": 5, "workdir": ".",
    "resources": {"provider": "local", "local": {"gpus": 2, "price_per_hour": 3600.0}},
    "recovery": {"poll_seconds": 1, "max_recoveries": 1},
    "run": "python3 trial.py",
}

TRIAL_PY = """\
import json, os, time
lr = float(os.environ["CLOUDTRAIN_PARAM_LR"])
with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
    for step in range(8):
        time.sleep(0.5)
        f.write(json.dumps({"step": step, "val_loss": lr * (8 - step)}) + "\\n")
        f.flush()
"""

SWEEP = f"""\
task: task.yaml
params:
  lr: {{loguniform: [0.01, 1.0]}}
objective: {{metric: val_loss, goal: minimize}}
trials: {TRIALS}
parallel: auto
gpus_per_trial: 1
sampler: random
pruner: none
down: true
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emus.Emulator]:
    pytest.importorskip("moto")
    emu = emus.start("s3", tmp_path_factory.mktemp("emulator"))
    yield emu
    emu.stop()


def _project(d: Path, emu: emus.Emulator | None) -> Path:
    task = dict(TASK)
    if emu is not None:
        task.update(checkpoints=emu.url("ck/rsw"), envs=dict(emu.envs))
    (d / "task.yaml").write_text(json.dumps(task))
    (d / "trial.py").write_text(TRIAL_PY)
    f = d / "rs.yaml"
    f.write_text(SWEEP)
    return f


def _take_head(cli: CLI) -> None:
    """The local 'preemption' of the head: its sshd and everything under it die at once."""
    node = cli.home / "clusters" / "rsw" / "local" / "nodes" / "0"
    for p in [int((node / "sshd.pid").read_text())] + processes_with(f"HOME={node / 'root'}"):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _results(cli: CLI, cwd: Path) -> dict:
    r = cli.run("sweep", "results", "rs", "--json", cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout))


def test_recover_without_checkpoints_is_refused_creating_nothing(cli: CLI, tmp_path: Path) -> None:
    f = _project(tmp_path, None)
    r = cli.run("sweep", str(f), "--recover", "-y", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "field 'checkpoints'" in r.stderr and "checkpoints: s3://" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())
    assert cli.status() == []


def test_the_sweep_resumes_from_the_bucket_when_the_head_is_lost(
        cli: CLI, tmp_path: Path, s3: emus.Emulator) -> None:
    f = _project(tmp_path, s3)
    proc = cli.popen("sweep", str(f), "--recover", "-y", CLOUDTRAIN_GUARD_POLL="0.3")
    try:
        def midway() -> bool:
            """Two trials done, and one running long enough for the bucket's copy to know it."""
            if proc.poll() is not None or not (cli.home / "state.db").exists():
                return proc.poll() is not None
            r = cli.run("sweep", "results", "rs", "--json", cwd=tmp_path)
            if r.returncode != 0:
                return False
            doc = json.loads(r.stdout)
            now = time.time()
            return doc["counts"]["complete"] >= 2 and any(
                t["state"] == "running" and t["started_at"] and now - t["started_at"] > 2.5
                for t in doc["trials"])

        assert wait_until(midway, 300, step=0.5)
        assert proc.poll() is None, proc.communicate()
        kept = s3.keys("ck/rsw/sweeps/rs")
        assert any(k.startswith("manifests/") for k in kept), kept
        _take_head(cli)
        out, err = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:] + err[-4000:]
    said = out + err
    assert "Recovery 1 of at most 1: replacing node(s) [0]" in said, said[-4000:]
    lost = [int(n) for n in re.findall(r"lost with a head: \[([0-9, ]+)\]", said)[-1].split(",")]
    doc = _results(cli, tmp_path)
    states = {t["number"]: t["state"] for t in doc["trials"]}
    assert sorted(states) == list(range(TRIALS)), doc          # the total, each number once
    assert lost and all(states[n] == "fail" for n in lost), (lost, states)
    assert doc["counts"]["fail"] == len(lost) and doc["counts"]["running"] == 0
    assert doc["counts"]["complete"] == TRIALS - len(lost), doc
    assert doc["finished"] and doc["best"] is not None
    assert cli.status() == []                   # down: true, by the controller at the end
    r = cli.run("cost-report", "--json")
    assert r.returncode == 0, r.stderr
    rows = [x for x in json.loads(r.stdout).get("recoveries", []) if x.get("cluster") == "rsw"]
    assert len(rows) == 1 and rows[0]["status"] == "RECOVERED" and rows[0]["ranks"] == [0], rows
    assert all(isinstance(rows[0][k], float) and rows[0][k] >= 0
               for k in ("detect_s", "replace_s", "bootstrap_s", "sync_s", "restart_s")), rows


@pytest.fixture(autouse=True)
def _cleanup(cli: CLI) -> Iterator[None]:
    yield
    subprocess.run([sys.executable, "-m", "cloudtrain", "down", "-a", "-y"], env=cli.env(),
                   capture_output=True, timeout=120)
    for pid in processes_with(str(cli.home)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
