"""An ended job's record in the node's queue (cloudtrain/node/queue.py) says which slots it
held (``ran_on``), while ``held`` is empty: a sweep's worker that first sees a short trial once
it has ended still records the GPUs it ran on (docs/sweep.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from cloudtrain.node import queue, sweepwork


def test_an_ended_job_keeps_the_slots_it_had_and_the_worker_reads_them(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / ".cloudtrain").mkdir(parents=True)
    (root / ".cloudtrain" / "slots").write_text("2")
    gate = tmp_path / "gate"
    for job in ("a", "b"):
        r = subprocess.run([sys.executable, queue.__file__, "submit", str(root), job, "me",
                            f"{time.time():.6f}", "t", "--gpus", "1"],
                           input=f'while [ ! -e "{gate}" ]; do sleep 0.05; done\n'.encode(),
                           capture_output=True, timeout=30)
        assert r.stdout.startswith(b"::started"), r.stdout + r.stderr
    dispatch = sweepwork.QueueDispatch(str(root), "t", 1.0)
    assert sorted(v.gpus for v in dispatch.jobs().values()) == [("0",), ("1",)]  # both run
    gate.write_text("")
    deadline = time.time() + 20
    while time.time() < deadline and any(
            v.state != "succeeded" for v in dispatch.jobs().values()):
        time.sleep(0.1)
    recs = {r["id"]: r for r in json.loads(subprocess.run(
        [sys.executable, queue.__file__, "list", str(root)], capture_output=True, timeout=30,
        check=True).stdout)}
    assert all(r["state"] == "succeeded" and r["held"] == [] for r in recs.values()), recs
    assert sorted(recs["a"]["ran_on"] + recs["b"]["ran_on"]) == [0, 1]
    views = dispatch.jobs()
    assert {v.gpus for v in views.values()} == {("0",), ("1",)}
    assert queue.allocate([dict(recs["a"]), {"id": "c", "state": "queued", "gpus": 2,
                                              "held": []}], "c", 2) == [0, 1]   # ran_on holds nothing
