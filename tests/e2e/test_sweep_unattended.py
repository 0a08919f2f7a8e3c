"""A sweep with the laptop gone, through the real CLI on a local node with 2 GPU slots
(docs/sweep.md, "Stopping a sweep", "Money", "Reading a sweep"): the CLI that started it is
SIGKILLed and the sweep finishes on the node; a CLI killed while the driver starts leaves a
sweep that is readable or says plainly that its driver never started; a budget that runs out
while trials run is enforced by the node guard (trials SIGTERMed, the driver stopped) and the
ledger shows the spend within one guard poll of the limit; with ``down: true`` the results the
head driver left survive the guard's teardown."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]

POLL = 0.5                              # the node guard's poll (CLOUDTRAIN_GUARD_POLL)
FAST = {"CLOUDTRAIN_GUARD_POLL": str(POLL)}

TASK = """\
name: {name}
num_nodes: 1
stop_grace: 3
resources: {{provider: local, local: {{gpus: 2{price}}}}}
run: |
  python3 - <<'PY'
  import json, os, signal, sys, time
  signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
  lr = float(os.environ["CLOUDTRAIN_PARAM_LR"])
  with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
      for step in range({steps}):
          time.sleep(0.3)
          f.write(json.dumps({{"step": step, "val_loss": lr * ({steps} - step)}}) + "\\n")
          f.flush()
  PY
"""

SWEEP = """\
task: task.yaml
params:
  lr: {{loguniform: [0.01, 1.0]}}
objective: {{metric: val_loss, goal: minimize}}
trials: {trials}
parallel: auto
gpus_per_trial: 1
sampler: random
pruner: none
down: {down}
{extra}"""


def write(tmp: Path, name: str, *, trials: int, steps: int, down: bool, price: float = 0,
          extra: str = "") -> Path:
    (tmp / "task.yaml").write_text(TASK.format(
        name=name, steps=steps, price=f", price_per_hour: {price}" if price else ""))
    f = tmp / f"{name}.yaml"
    f.write_text(SWEEP.format(trials=trials, down=str(down).lower(), extra=extra))
    return f


def driver_running(cli: CLI, name: str) -> bool:
    """The head driver (``sweep.py head ROOT NAME``) of this home's cluster runs."""
    return any(_cmdline(p).find(b"sweep.py\0head\0") >= 0
               for p in processes_with(f"{cli.home}/clusters/{name}/"))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_and_kill(cli: CLI, f: Path, name: str, when: Any) -> subprocess.Popen[str]:
    """``cloudtrain sweep FILE -y``, SIGKILLed as soon as ``when()`` holds (the laptop is gone)."""
    proc = cli.popen("sweep", str(f), "-y", **FAST)
    assert wait_until(lambda: when() or proc.poll() is not None, 180, step=0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return proc


def results(cli: CLI, name: str, tmp: Path) -> dict[str, Any]:
    r = cli.run("sweep", "results", name, "--json", cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def status(cli: CLI, name: str, tmp: Path) -> str:
    r = cli.run("sweep", "status", name, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return r.stdout


def every_trial_ended_with_its_value(doc: dict[str, Any], trials: int) -> None:
    assert doc["finished"] and not doc["incomplete"], doc
    assert doc["counts"]["complete"] == trials and len(doc["trials"]) == trials, doc
    values = {t["number"]: t["value"] for t in doc["trials"]}
    assert all(isinstance(v, float) for v in values.values()), values
    assert doc["best"] == min(values, key=lambda n: values[n])
    assert all(len(t["gpus"]) == 1 and t["ended_at"] for t in doc["trials"]), doc


def test_the_laptop_leaves_and_the_sweep_finishes_on_the_node(cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path, "gone", trials=6, steps=4, down=False)
    start_and_kill(cli, f, "gone", lambda: driver_running(cli, "gone"))
    # The driver marks itself as the sweep's job on the head (whatever the killed CLI wrote).
    pid_file = cli.home / "clusters/gone/local/nodes/0/root/jobs/sweep-gone/pid"
    assert wait_until(pid_file.exists, 30)

    def finished() -> bool:
        return "(finished)" in status(cli, "gone", tmp_path)

    assert wait_until(finished, 240, step=2)
    doc = results(cli, "gone", tmp_path)
    every_trial_ended_with_its_value(doc, 6)
    out = status(cli, "gone", tmp_path)
    assert "complete: 6" in out and f"best: trial {doc['best']}" in out
    assert "[##############################] 6/6" in out


def test_a_cli_killed_while_the_driver_starts_leaves_nothing_that_lies(
        cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path, "early", trials=2, steps=2, down=False)
    db = cli.home / "state.db"

    def recorded() -> bool:
        try:
            with sqlite3.connect(db) as c:
                return c.execute("SELECT count(*) FROM sweeps").fetchone()[0] > 0
        except sqlite3.Error:
            return False

    start_and_kill(cli, f, "early", recorded)
    time.sleep(2)
    r = cli.run("sweep", "status", "early", cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 2:          # killed before the driver started: said plainly
        assert "its driver never started" in r.stderr and "cloudtrain sweep" in r.stderr
        assert "Sweep early on cluster" not in r.stdout
        r = cli.run("sweep", str(f), "-y", cwd=tmp_path, **FAST)      # started again
        assert r.returncode == 0, r.stdout + r.stderr
    else:                          # the driver was running: a readable sweep
        assert r.returncode == 0 and "Sweep early on cluster early" in r.stdout, r.stderr
    assert wait_until(lambda: "(finished)" in status(cli, "early", tmp_path), 240, step=2)
    every_trial_ended_with_its_value(results(cli, "early", tmp_path), 2)


def test_down_true_the_results_survive_the_guards_teardown(cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path, "downed", trials=4, steps=3, down=True)
    start_and_kill(cli, f, "downed", lambda: driver_running(cli, "downed"))
    # Nobody reads the sweep: it ends, the guard takes the cluster down (job-end).
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/downed/"), 240, step=1), \
        "the nodes did not stop themselves"
    doc = results(cli, "downed", tmp_path)       # the next contact removes the cluster
    every_trial_ended_with_its_value(doc, 4)
    assert doc["cluster_gone"] and "job-end" in doc["cluster_gone"], doc
    assert cli.status() == []
    assert_nothing_left(cli.home)
    out = status(cli, "downed", tmp_path)
    assert "(finished)" in out and "final results" in out and "complete: 4" in out
    rep = cli.run("cost-report", "--json", "--offline")
    (entry,) = json.loads(rep.stdout)["sweeps"]
    assert entry["finished"] and len(entry["trials"]) == 4, entry


PRICE = 36.0                # $/h of the node: $0.01 a second
CAP = 0.30                  # the sweep's budget: reached ~30 s after the cluster was created


def test_a_budget_that_runs_out_mid_sweep_is_enforced_by_the_node_guard(
        cli: CLI, tmp_path: Path) -> None:
    # The estimate (4 trials on 2 slots: 2 rounds of 0.004 h at $36/h = $0.288) fits the
    # budget; the real trials run 60 s each, so the budget runs out while they run.
    f = write(tmp_path, "spent", trials=4, steps=200, down=True, price=PRICE,
              extra=f"max_cost_usd: {CAP}\ntrial_hours: 0.004\n")
    start_and_kill(cli, f, "spent", lambda: driver_running(cli, "spent"))
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/spent/"), 240, step=0.5), \
        "the node guard did not stop the cluster"
    out = status(cli, "spent", tmp_path)
    assert "stopped: the cluster's budget (max_cost_usd) was spent" in out, out
    assert "(finished)" in out and "went down (budget)" in out, out
    doc = results(cli, "spent", tmp_path)
    assert doc["stopped"].startswith("the cluster's budget") and doc["finished"], doc
    # The trials that ran were stopped (SIGTERM, in their grace), none left running.
    assert doc["counts"]["running"] == 0 and doc["counts"]["fail"] >= 1, doc
    assert all(t["ended_at"] for t in doc["trials"]), doc
    assert_nothing_left(cli.home)

    rep = cli.run("cost-report", "--json", "--offline")
    assert rep.returncode == 0, rep.stderr
    ledger = json.loads(rep.stdout)
    (c,) = [c for c in ledger["clusters"] if c["name"] == "spent"]
    assert c["end_reason"] == "budget", c
    # The cluster's spend: the limit, give or take one guard poll at the price (and the
    # moment the stopped trials took to exit: SIGTERM, not their whole grace).
    rate = PRICE / 3600
    assert CAP - 1e-4 <= c["cost_usd"] <= CAP + rate * (POLL + 1.5), c
    (entry,) = ledger["sweeps"]
    assert entry["finished"] and entry["stopped"].startswith("the cluster's budget"), entry
    assert 0 < entry["spent_usd"] <= c["cost_usd"] + 1e-6, (entry, c)
    assert entry["spent_usd"] == pytest.approx(
        sum(t["cost_usd"] for t in entry["trials"]), abs=1e-5)
