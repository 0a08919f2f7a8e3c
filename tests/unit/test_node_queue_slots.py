"""GPU slots in the node's queue (cloudtrain/node/queue.py), in-process and through its
command line: the slot count, the allocation (lowest free slots, submission order, whole-node
jobs), CUDA_VISIBLE_DEVICES of a started job, and the slots freed when a job ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from cloudtrain.node import guard, queue

QUEUE_PY = queue.__file__


def _rec(job_id: str, state: str, gpus: int | None, held: list[int] | None = None) -> dict:
    return {"id": job_id, "state": state, "gpus": gpus, "held": held or []}


def test_slots_reads_the_slot_file_and_defaults_to_one(tmp_path: Path) -> None:
    assert queue.slots(str(tmp_path)) == 1
    (tmp_path / ".cloudtrain").mkdir()
    (tmp_path / ".cloudtrain" / "slots").write_text("4\n")
    assert queue.slots(str(tmp_path)) == 4
    for bad in ("", "x", "0", "-3"):
        (tmp_path / ".cloudtrain" / "slots").write_text(bad)
        assert queue.slots(str(tmp_path)) == 1


def test_allocate_gives_the_lowest_free_slots() -> None:
    recs = [_rec("a", "running", 1, [0]), _rec("b", "queued", 2)]
    assert queue.allocate(recs, "b", 4) == [1, 2]
    recs = [_rec("a", "running", 1, [1]), _rec("b", "queued", 1)]
    assert queue.allocate(recs, "b", 2) == [0]
    # Too few free: it waits.
    recs = [_rec("a", "running", 1, [0]), _rec("b", "running", 1, [1]), _rec("c", "queued", 1)]
    assert queue.allocate(recs, "c", 2) is None
    # Ended jobs hold nothing, whatever their record says.
    recs = [_rec("a", "succeeded", 1, [0]), _rec("c", "queued", 2)]
    assert queue.allocate(recs, "c", 2) == [0, 1]


def test_a_whole_node_job_waits_for_every_slot_and_holds_them_all() -> None:
    recs = [_rec("a", "running", 1, [0]), _rec("w", "queued", None)]
    assert queue.allocate(recs, "w", 2) is None
    recs = [_rec("w", "queued", None)]
    assert queue.allocate(recs, "w", 3) == [0, 1, 2]
    # A running record written before slots existed holds the whole node.
    old = [{"id": "o", "state": "running"}, _rec("b", "queued", 1)]
    assert queue.held(old[0], 2) == [0, 1]
    assert queue.allocate(old, "b", 2) is None


def test_jobs_start_in_submission_order() -> None:
    # A whole-node job waits for the slot held by 'a'; 'c' behind it does not jump the queue.
    recs = [_rec("a", "running", 1, [0]), _rec("w", "queued", None), _rec("c", "queued", 1)]
    assert queue.allocate(recs, "c", 2) is None
    assert queue.allocate(recs, "x", 2) is None   # not in the queue


def test_gpus_option_is_parsed_and_checked() -> None:
    assert queue.gpus_option(["r", "j", "--gpus", "2"]) == (["r", "j"], 2)
    assert queue.gpus_option(["r", "j"]) == (["r", "j"], None)
    for bad in (["--gpus"], ["--gpus", "0"], ["--gpus", "-1"], ["--gpus", "x"]):
        with pytest.raises(ValueError, match="--gpus"):
            queue.gpus_option(bad)


def _submit(root: Path, job_id: str, script: str, *extra: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, QUEUE_PY, "submit", str(root), job_id, "me",
                           f"{time.time():.6f}", "t", *extra], input=script.encode(),
                          capture_output=True, timeout=30)


def _list(root: Path) -> dict[str, dict]:
    out = subprocess.run([sys.executable, QUEUE_PY, "list", str(root)], capture_output=True,
                         timeout=30, check=True).stdout
    return {r["id"]: r for r in json.loads(out)}


def _until(what: Callable[[], object], timeout: float = 20.0) -> object:
    end = time.time() + timeout
    while time.time() < end:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_the_queue_pins_jobs_to_free_slots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / ".cloudtrain").mkdir(parents=True)
    (root / ".cloudtrain" / "slots").write_text("2")
    gate = tmp_path / "gate"
    script = (f'echo "$CUDA_VISIBLE_DEVICES" > "{tmp_path}/$CT_NAME"; '
              f'while [ ! -e "{gate}" ]; do sleep 0.05; done\n')
    out = [_submit(root, f"j{i}", f"CT_NAME=j{i}; " + script, "--gpus", "1") for i in range(3)]
    assert [o.stdout.decode().split()[0] for o in out] == ["::started"] * 2 + ["::queued"]
    _until(lambda: (tmp_path / "j0").exists() and (tmp_path / "j1").exists())
    seen = {(tmp_path / f"j{i}").read_text().strip() for i in range(2)}
    assert seen == {"0", "1"}
    recs = _list(root)
    assert sorted(recs["j0"]["held"] + recs["j1"]["held"]) == [0, 1]
    assert recs["j2"]["state"] == "queued" and recs["j2"]["held"] == [] and recs["j2"]["gpus"] == 1
    # The guard sees both running jobs.
    assert len(guard.running_jobs(str(root))) == 2
    # Too many GPUs: refused, nothing queued.
    bad = _submit(root, "big", "true\n", "--gpus", "3")
    assert bad.returncode == 2 and b"::refused gpus_per_job is 3" in bad.stdout
    assert "big" not in _list(root)
    gate.write_text("")
    _until(lambda: _list(root)["j2"]["state"] == "succeeded")
    recs = _list(root)
    assert all(r["held"] == [] for r in recs.values())
    assert (tmp_path / "j2").read_text().strip() in ("0", "1")


def test_a_whole_node_job_sees_no_cuda_visible_devices(tmp_path: Path) -> None:
    root = tmp_path / "root"
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    out = _submit(root, "w", f'echo "[${{CUDA_VISIBLE_DEVICES-unset}}]" > "{tmp_path}/w"\n')
    assert out.stdout.decode().startswith("::started")
    _until(lambda: _list(root)["w"]["state"] == "succeeded")
    assert (tmp_path / "w").read_text().strip() == "[unset]"
    assert _list(root)["w"]["gpus"] is None
