"""The sweep on several nodes (cloudtrain/node/sweep.py, docs/sweep.md "What runs where"),
run as the nodes run it: the shipped files side by side with the node's real queue.py, one
folder per node, the head serving its study on its internal address (here 127.0.0.1) and a
port it picks, a worker on the other node reaching it there.

- ``start`` waits for the head's proxy and prints its port; ``worker`` records its pid as
  the job ``sweep-NAME.worker`` (work for the node's guard); both nodes run trials, with
  different params (the samplers are seeded seed + rank); once the sweep has ended the
  worker marks the end of the job ``sweep-NAME`` on its node, and the head ends once the
  final results were read, marking it on its own;
- the proxy listens on the head's address only, not on every interface;
- a worker whose head is lost ends without marking the sweep's end: its node's guard never
  sees the job ``sweep-NAME`` end (``down_on_end`` does not fire);
- a head that cannot serve its study makes ``start`` fail, saying why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import node_bundle

from cloudtrain.node import guard, sweepstudy

pytest.importorskip("grpc")

TRIAL = r"""
python3 - <<'PY'
import json, os, time
lr = float(os.environ["CLOUDTRAIN_PARAM_LR"])
with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
    for step in range(1, 4):
        time.sleep(float(os.environ.get("STEP_S", "0.05")))
        f.write(json.dumps({"step": step, "val_loss": lr * 100 + 1 / step}) + "\n")
        f.flush()
PY
"""
HEAD, OTHER = "127.0.0.1", "127.0.0.2"
ENV = {**os.environ, "CLOUDTRAIN_SWEEP_POLL": "0.05"}


def shipped(tmp_path: Path, node: str) -> tuple[Path, Path]:
    """A node: its copy of the driver beside its queue.py, its ROOT with 2 GPU slots."""
    d = tmp_path / node
    node_bundle(d / "bin")
    (d / "root" / ".cloudtrain").mkdir(parents=True)
    (d / "root" / ".cloudtrain" / "slots").write_text("2")
    return d / "bin" / "sweep.py", d / "root"


def spec(tmp_path: Path, script: str = TRIAL, **over: Any) -> Path:
    doc = {"params": {"lr": {"kind": "loguniform", "low": 1e-4, "high": 1e-1}},
           "objective": {"metric": "val_loss", "goal": "minimize"}, "trials": 8,
           "parallel": "auto", "gpus_per_trial": 1, "sampler": "random", "pruner": "none",
           "seed": 7, "slots": 2, "script": script, "host": HEAD, "nodes": [HEAD, OTHER],
           "stop_grace": 1}
    doc.update(over)
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(doc))
    return p


def cmd(script: Path, *args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                         timeout=180, env=ENV)
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


def alive(pid: int) -> bool:
    return guard.alive(pid)


def wait(pred: Any, timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return bool(pred())


def test_two_nodes_share_the_study_and_the_worker_marks_the_sweeps_end(tmp_path: Path) -> None:
    head, root0 = shipped(tmp_path, "n0")
    other, root1 = shipped(tmp_path, "n1")
    rc, started = cmd(head, "start", str(root0), "s", str(spec(tmp_path)))
    assert rc == 0 and started["pid"] > 0 and started["port"] > 0, started
    assert json.loads((root0 / ".cloudtrain/sweeps/s/proxy.json").read_text()) == \
        {"host": HEAD, "port": started["port"]}
    rc, w = cmd(other, "worker", str(root1), "s", HEAD, str(started["port"]), "1")
    assert rc == 0 and w["job"] == "sweep-s.worker", w
    assert (root1 / "jobs/sweep-s.worker/pid").read_text().strip() == str(w["pid"])
    assert [os.path.basename(d) for d, _ in guard.running_jobs(str(root1))] == ["sweep-s.worker"]

    # The study, read on the head's disk: finished, trials from both nodes.
    def report() -> dict:
        return sweepstudy.report(sweepstudy.read_study(str(root0), "s"), with_trials=True)

    assert wait(lambda: report()["finished"]), report()
    doc = report()
    assert doc["counts"]["complete"] == len(doc["trials_list"]) >= 8, doc
    assert {t["node"] for t in doc["trials_list"]} == {HEAD, OTHER}, doc
    lrs = [t["params"]["lr"] for t in doc["trials_list"]]
    assert len(set(lrs)) == len(lrs), lrs       # seed + rank: no draw repeated on the other node

    # The worker leaves and marks the sweep's end on its node; the head waits for a reader.
    assert wait(lambda: not alive(w["pid"]))
    assert guard.job_ended(str(root1), "sweep-s") is not None
    assert guard.running_jobs(str(root1)) == []
    time.sleep(1.0)
    assert alive(started["pid"]), "the head ended before the final results were read"
    rc, res = cmd(head, "results", str(root0), "s")
    assert rc == 0 and res["finished"]
    assert wait(lambda: not alive(started["pid"]), 30)
    assert (root0 / "jobs/sweep-s/rc").read_text() == "0\n"    # the head's end of sweep-s
    assert guard.job_ended(str(root0), "sweep-s") is not None


def test_the_proxy_listens_on_the_heads_address_only(tmp_path: Path) -> None:
    head, root0 = shipped(tmp_path, "n0")
    rc, started = cmd(head, "start", str(root0), "s",
                      str(spec(tmp_path, TRIAL.replace("range(1, 4)", "range(1, 400)"),
                               nodes=[HEAD])))
    assert rc == 0, started
    try:
        socket.create_connection((HEAD, started["port"]), timeout=5).close()
        with pytest.raises(OSError):
            socket.create_connection((OTHER, started["port"]), timeout=5).close()
    finally:
        assert cmd(head, "cancel", str(root0), "s")[0] == 0
        # Its trials stop; once a reader has the final results (nothing runs), it ends.
        assert wait(lambda: cmd(head, "results", str(root0), "s")[0] == 0
                    and not alive(started["pid"]), 60)


def test_a_worker_that_loses_the_head_never_marks_the_sweeps_end(tmp_path: Path) -> None:
    head, root0 = shipped(tmp_path, "n0")
    other, root1 = shipped(tmp_path, "n1")
    slow = TRIAL.replace("range(1, 4)", "range(1, 400)")
    rc, started = cmd(head, "start", str(root0), "s", str(spec(tmp_path, slow)))
    assert rc == 0, started
    rc, w = cmd(other, "worker", str(root1), "s", HEAD, str(started["port"]), "1")
    assert rc == 0, w
    assert wait(lambda: len(list((root1 / "jobs").glob("sweep-s-t*"))) == 2)
    os.killpg(started["pid"], signal.SIGKILL)        # the head is lost
    assert wait(lambda: not alive(w["pid"]), 120), \
        (root1 / ".cloudtrain/sweeps/s/worker.log").read_text()[-2000:]
    assert not (root1 / "jobs/sweep-s/rc").exists()
    assert guard.job_ended(str(root1), "sweep-s") is None       # down_on_end never fires
    for job in root1.glob("jobs/sweep-s-t*/pid"):               # the trials it left
        try:
            os.killpg(int(job.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_start_says_why_a_head_could_not_serve_its_study(tmp_path: Path) -> None:
    head, root0 = shipped(tmp_path, "n0")
    rc, said = cmd(head, "start", str(root0), "s", str(spec(tmp_path, host="192.0.2.1")))
    assert rc == 1 and "the sweep's head exited" in said["error"], said
    assert "192.0.2.1" in said["error"] or "Cannot assign" in said["error"], said
