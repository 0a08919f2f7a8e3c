"""``cloudtrain sweep`` through the real CLI (docs/sweep.md): a bad sweep file exits 2 naming
the field and creates nothing; a sweep whose trials cannot fit ``max_cost_usd`` is refused
before anything is created, saying how many trials would fit; reading a sweep that was never
started exits 2; a small sweep on local nodes runs every trial and names the best."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, wait_until


TASK = """\
name: exp
num_nodes: 2
max_hours: 1
resources:
  local: {price_per_hour: 2.0}
run: python3 -c 'print(1)'
"""

SWEEP = """\
task: task.yaml
cluster: exp
params:
  lr: {{loguniform: [1.0e-5, 1.0e-2]}}
objective: {{metric: val_loss, goal: minimize}}
trials: {trials}
parallel: auto
gpus_per_trial: 1
sampler: {sampler}
pruner: median
max_cost_usd: {budget}
trial_hours: 0.5
down: true
"""


def write(tmp: Path, *, trials: int = 4, sampler: str = "tpe", budget: float = 30) -> Path:
    (tmp / "task.yaml").write_text(TASK)
    p = tmp / "search.yaml"
    p.write_text(SWEEP.format(trials=trials, sampler=sampler, budget=budget))
    return p


def run(cli: CLI, *args: str, cwd: Path,
        **extra: str) -> subprocess.CompletedProcess[str]:
    return cli.run("sweep", *args, cwd=cwd, **extra)


def created_nothing(cli: CLI) -> None:
    clusters = cli.home / "clusters"
    assert not clusters.exists() or not any(clusters.iterdir())
    assert cli.status() == []
    r = cli.run("cost-report", "--json", "--offline")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["sweeps"] == [] and doc["clusters"] == []


def test_bad_sweep_file_exits_2_naming_the_field(cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path, sampler="annealing")
    r = run(cli, str(f), "-y", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "sampler" in r.stderr and "Traceback" not in r.stderr
    created_nothing(cli)


def test_gpus_per_trial_above_a_nodes_gpus_exits_2_naming_the_field(
        cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path)
    f.write_text(f.read_text().replace("gpus_per_trial: 1", "gpus_per_trial: 2"))
    r = run(cli, str(f), "-y", cwd=tmp_path)        # the task's local nodes have 1 slot each
    assert r.returncode == 2, r.stdout + r.stderr
    assert "field 'gpus_per_trial'" in r.stderr and "1 GPU slot(s)" in r.stderr
    created_nothing(cli)


def test_budget_refused_before_anything_is_created(cli: CLI, tmp_path: Path) -> None:
    # 40 trials, 2 at a time (2 nodes x 1 slot), 0.5 h each on $4/h: $40 > $10.
    f = write(tmp_path, trials=40, budget=10)
    r = run(cli, str(f), "-y", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "$40.0000" in r.stderr and "max_cost_usd" in r.stderr
    assert "10 trial(s) fit this budget" in r.stderr
    created_nothing(cli)


def test_options_may_come_before_the_file_and_a_missing_file_exits_2(
        cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path, trials=40, budget=0.5)
    r = run(cli, "-c", "other", "-y", str(f), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Not one round of 2 trial(s) fits this budget" in r.stderr
    r = run(cli, str(tmp_path / "nosuch.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    created_nothing(cli)


def test_reading_an_unknown_sweep_exits_2(cli: CLI, tmp_path: Path) -> None:
    for cmd in ("status", "results", "cancel"):
        r = run(cli, cmd, "nosuch", cwd=tmp_path)
        assert r.returncode == 2, (cmd, r.stdout + r.stderr)
        assert "No sweep named 'nosuch'" in r.stderr


def test_help_shows_the_file_and_the_subcommands(cli: CLI, tmp_path: Path) -> None:
    r = run(cli, "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "SWEEP.yaml" in r.stdout
    for cmd in ("status", "results", "cancel"):
        assert cmd in r.stdout
    assert "start " not in r.stdout.split("Commands:")[-1]


# --- a small sweep on local nodes, once node/sweep.py (helper "driver") is in the tree ---------

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3"}

TRIAL = """\
name: small
num_nodes: 1
stop_grace: 5
resources: {provider: local, local: {gpus: 2}}
run: |
  python3 - <<'PY'
  import json, os, time
  lr = float(os.environ["CLOUDTRAIN_PARAM_LR"])
  with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
      for step in range(3):
          time.sleep(0.2)
          f.write(json.dumps({"step": step, "val_loss": lr * (3 - step)}) + "\\n")
          f.flush()
  PY
"""

SMALL = """\
task: task.yaml
params:
  lr: {loguniform: [0.01, 1.0]}
objective: {metric: val_loss, goal: minimize}
trials: 4
parallel: auto
gpus_per_trial: 1
sampler: random
pruner: none
down: false
"""


@pytest.mark.e2e
@needs_sshd
def test_a_small_sweep_on_local_nodes_runs_every_trial_and_names_the_best(
        cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text(TRIAL)
    f = tmp_path / "small.yaml"
    f.write_text(SMALL)
    r = run(cli, str(f), "-y", cwd=tmp_path, **FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Sweep small started on cluster small" in r.stdout + r.stderr

    def finished() -> bool:
        s = run(cli, "status", "small", cwd=tmp_path)
        assert s.returncode == 0, s.stdout + s.stderr
        return "(finished)" in s.stdout

    assert wait_until(finished, 240, step=2)
    r = run(cli, "results", "small", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["counts"]["complete"] == 4 and len(doc["trials"]) == 4, doc
    values = {t["number"]: t["value"] for t in doc["trials"]}
    assert doc["best"] == min(values, key=lambda n: values[n])
    assert all(len(t["gpus"]) == 1 for t in doc["trials"]), doc
    r = run(cli, "results", "small", "--plot", str(tmp_path / "s.png"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert "complete" in run(cli, "results", "small", "--csv", cwd=tmp_path).stdout


@pytest.mark.e2e
@needs_sshd
def test_the_budget_counts_what_an_existing_cluster_has_cost(cli: CLI, tmp_path: Path) -> None:
    # The budget on the guards is the cluster's: a sweep on a cluster that is up adds its
    # trials to what the cluster has already cost, and is refused without touching it.
    f = write(tmp_path, trials=20, budget=20)        # $20 exactly for 10 rounds of $2...
    r = cli.run("up", str(tmp_path / "task.yaml"), "-y", "--no-bootstrap", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run(cli, str(f), "-y", cwd=tmp_path)          # ...plus what exp has cost since up
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the cluster has already cost" in r.stderr and "18 trial(s) fit" in r.stderr
    assert [e["name"] for e in cli.status()] == ["exp"]
    assert run(cli, "status", "search", cwd=tmp_path).returncode == 2     # no sweep recorded
