"""The head driver's end with no laptop (cloudtrain/node/sweep.py, docs/sweep.md "Stopping a
sweep", "Reading a sweep"): the shipped driver over the node's real queue marks itself as the
sweep's job, keeps results.json, and on the node guard's SIGTERM (a budget) stops the sweep
with the guard's reason in words and tells its running trials FAIL once they ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import node_bundle


TRIAL = r"""
exec python3 - <<'PY'
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
    for step in range(600):
        time.sleep(0.1)
        f.write(json.dumps({"step": step, "val_loss": 1.0}) + "\n")
        f.flush()
PY
"""


def shipped(tmp: Path) -> tuple[Path, Path]:
    """sweep.py as a node holds it (its siblings and the real queue.py beside it), and ROOT
    with 2 GPU slots."""
    node, root = tmp / "node", tmp / "root"
    node.mkdir()
    node_bundle(node)
    (root / ".cloudtrain").mkdir(parents=True)
    (root / ".cloudtrain" / "slots").write_text("2")
    return node / "sweep.py", root


def results(root: Path) -> dict:
    return json.loads((root / ".cloudtrain/sweeps/s1/results.json").read_text())


def wait(pred, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    end = time.time() + timeout
    while not pred():
        assert time.time() < end, "timed out"
        time.sleep(0.1)


def test_the_guards_sigterm_stops_the_sweep_with_its_reason_and_leaves_the_results(
        tmp_path: Path) -> None:
    script, root = shipped(tmp_path)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "params": {"lr": {"kind": "loguniform", "low": 1e-4, "high": 1e-1}},
        "objective": {"metric": "val_loss", "goal": "minimize"}, "trials": 6,
        "parallel": "auto", "gpus_per_trial": 1, "sampler": "random", "pruner": "none",
        "slots": 2, "script": TRIAL, "stop_grace": 3}))
    env = {**os.environ, "CLOUDTRAIN_SWEEP_POLL": "0.1"}
    out = subprocess.run([sys.executable, str(script), "start", str(root), "s1", str(spec)],
                         capture_output=True, text=True, env=env, check=True, timeout=60)
    pid = json.loads(out.stdout.splitlines()[-1])["pid"]
    pid_file = root / "jobs/sweep-s1/pid"
    wait(lambda: pid_file.exists())                  # the driver marked itself
    assert int(pid_file.read_text()) == pid
    wait(lambda: (root / ".cloudtrain/sweeps/s1/results.json").exists()
         and results(root)["counts"]["running"] == 2)
    # The guard's stop: stopped.json first, then SIGTERM to every running job's group.
    guard = root / ".cloudtrain/guard"
    guard.mkdir(parents=True)
    (guard / "stopped.json").write_text(json.dumps({"reason": "budget", "at": time.time()}))
    jobs = [d for d in (root / "jobs").iterdir() if not (d / "rc").exists()]
    for d in jobs:
        os.killpg(int((d / "pid").read_text()), signal.SIGTERM)
    wait(lambda: not os.path.exists(f"/proc/{pid}") or
         Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 30)
    doc = results(root)
    assert doc["stopped"].startswith("the cluster's budget (max_cost_usd) was spent"), doc
    assert doc["finished"] and doc["counts"]["running"] == 0, doc
    assert doc["counts"]["fail"] == 2 and len(doc["trials_list"]) == 2, doc
    assert all(t["ended"] for t in doc["trials_list"]), doc
    assert doc["written_at"] >= doc["trials_list"][0]["ended"]
