"""A sweep's trials' outputs through the real CLI on a local node with 2 GPU slots
(docs/sweep.md, "Outputs"): two trials at a time, each in its own copy of the synced workdir
(a file one appends to in place changes only its copy; the outputs one writes are not
overwritten by the other's), the ended trials' outputs pulled into
OUTPUTS_DIR/sweep-NAME/trial-N with the best linked, and ``down`` pulling what was never
pulled before it removes the node. The task's ``setup:`` runs once on the node before the
trials (the launch chain's setup step)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, wait_until

TASK = """\
name: outs
num_nodes: 1
stop_grace: 5
workdir: .
outputs: [outputs/]
resources: {provider: local, local: {gpus: 2}}
setup: echo ran >> setup-runs.txt
run: |
  python3 - <<'PY'
  import json, os, time
  with open("setup-runs.txt") as f:          # setup ran once, before this trial (its copy)
      assert f.read() == "ran\\n", "setup did not run once before the trial"
  n, lr = int(os.environ["CLOUDTRAIN_TRIAL"]), float(os.environ["CLOUDTRAIN_PARAM_LR"])
  with open("notes.txt", "a") as f:          # a workdir file, appended to in place
      f.write(f"trial {n}\\n")
  os.makedirs("outputs", exist_ok=True)
  mine = {"trial": n, "lr": lr, "cwd": os.getcwd(), "dir": os.environ["CLOUDTRAIN_TRIAL_DIR"]}
  with open("outputs/result.json", "w") as f:
      json.dump(mine, f)
  for step in range(3):
      time.sleep(0.4)
      with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
          f.write(json.dumps({"step": step, "val_loss": lr * (3 - step)}) + "\\n")
  with open("outputs/result.json") as f:     # no other trial wrote over it meanwhile
      assert json.load(f) == mine, "another trial overwrote outputs/result.json"
  PY
"""

SWEEP = """\
task: task.yaml
params:
  lr: {loguniform: [0.01, 1.0]}
objective: {metric: val_loss, goal: minimize}
trials: 4
gpus_per_trial: 1
sampler: random
pruner: none
"""

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3"}
NOTES = "written on the laptop\n"


def start_and_finish(cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text(TASK)
    (tmp_path / "notes.txt").write_text(NOTES)
    (tmp_path / "outs.yaml").write_text(SWEEP)
    r = cli.run("sweep", "outs.yaml", "-y", cwd=tmp_path, **FAST)
    assert r.returncode == 0, r.stdout + r.stderr

    def finished() -> bool:
        s = cli.run("sweep", "status", "outs", cwd=tmp_path)
        assert s.returncode == 0, s.stdout + s.stderr
        return "(finished)" in s.stdout

    assert wait_until(finished, 240, step=2)


def check_trial(top: Path, t: dict) -> Path:
    """Trial ``t``'s outputs came back, its own; it ran in its own copy of the workdir."""
    got = json.loads((top / f"trial-{t['number']}" / "outputs" / "result.json").read_text())
    assert got["trial"] == t["number"] and got["lr"] == t["params"]["lr"], got
    work = Path(got["cwd"])
    assert work == Path(got["dir"]) / "work" and work.parent.name == str(t["number"])
    assert not (top / f"trial-{t['number']}" / "notes.txt").exists()   # not an output
    return work


@pytest.mark.e2e
@needs_sshd
def test_each_trial_has_its_own_workdir_and_its_outputs_come_back_with_the_best_named(
        cli: CLI, tmp_path: Path) -> None:
    start_and_finish(cli, tmp_path)
    r = cli.run("sweep", "outputs", "outs", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Outputs of 4 trial(s)" in r.stdout and "(4 pulled now)" in r.stdout, r.stdout
    r = cli.run("sweep", "results", "outs", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)                   # stdout stays one JSON document
    assert doc["counts"]["complete"] == 4, doc   # no trial saw its result.json overwritten
    spans = sorted((t["started_at"], t["ended_at"]) for t in doc["trials"])
    assert max(sum(1 for s, e in spans if s <= at < e) for at, _ in spans) == 2, spans

    top = tmp_path / "cloudtrain-outputs" / "sweep-outs"
    dirs = set()
    for t in doc["trials"]:
        work = check_trial(top, t)
        # its copy of the workdir got its own line only; the synced workdir none
        assert (work / "notes.txt").read_text() == NOTES + f"trial {t['number']}\n"
        assert (work.parents[5] / "workdir" / "notes.txt").read_text() == NOTES
        assert (work.parents[5] / "workdir" / "setup-runs.txt").read_text() == "ran\n"
        dirs.add(work)
    assert len(dirs) == 4
    assert os.readlink(top / "best") == f"trial-{doc['best']}"
    assert f"Best trial's outputs: {top / ('trial-' + str(doc['best']))}" in r.stderr
    r = cli.run("sweep", "outputs", "outs", cwd=tmp_path)
    assert r.returncode == 0 and "(0 pulled now)" in r.stdout, r.stdout + r.stderr
    # `cloudtrain outputs` of the sweep's job is the same pull: nothing new, finished
    (top / "best").unlink()
    r = cli.run("outputs", "outs", "--job", "sweep-outs", cwd=tmp_path)
    assert r.returncode == 0 and "has not ended" not in r.stderr, r.stdout + r.stderr
    assert os.readlink(top / "best") == f"trial-{doc['best']}"
    r = cli.run("down", "outs", "-y", cwd=tmp_path)           # all pulled: nothing to pull
    assert r.returncode == 0, r.stdout + r.stderr
    assert "never" not in r.stderr, r.stderr


@pytest.mark.e2e
@needs_sshd
def test_down_pulls_the_trials_outputs_never_pulled_before_the_node_goes(
        cli: CLI, tmp_path: Path) -> None:
    start_and_finish(cli, tmp_path)
    top = tmp_path / "cloudtrain-outputs" / "sweep-outs"
    assert not top.exists()                      # status pulls nothing
    r = cli.run("down", "outs", "-y", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outputs of sweep outs were never all pulled" in r.stderr, r.stderr
    got = {n: json.loads((top / f"trial-{n}" / "outputs" / "result.json").read_text())
           for n in range(4)}
    assert all(g["trial"] == n for n, g in got.items()), got
    assert not list(top.glob(".trial-*"))        # no partial pull left behind
    # the best: the lowest final val_loss (lr * 1 at the last step), i.e. the lowest lr
    assert os.readlink(top / "best") == f"trial-{min(got, key=lambda n: got[n]['lr'])}"


@pytest.mark.e2e
@needs_sshd
def test_a_setup_that_fails_stops_the_sweep_before_its_driver_starts(
        cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text(TASK.replace("setup: echo ran >> setup-runs.txt",
                                                     "setup: echo broken >&2; exit 3"))
    (tmp_path / "outs.yaml").write_text(SWEEP)
    r = cli.run("sweep", "outs.yaml", "-y", cwd=tmp_path, **FAST)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "setup failed on node 0 (exit code 3)" in r.stderr, r.stderr
    assert cli.run("sweep", "status", "outs", cwd=tmp_path).returncode == 2   # never recorded
    assert cli.run("down", "outs", "-y", cwd=tmp_path).returncode == 0
