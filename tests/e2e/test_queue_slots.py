"""GPU slots through the real CLI on one local node with 2 declared slots (docs/queue.md):
`gpus_per_job: 1` jobs run two at once, each pinned to its own CUDA_VISIBLE_DEVICES, the
third waits and takes the slot of the first that ends, `queue` shows the GPUs each job holds,
`cancel` of a running job frees its slot for the waiting one, and a whole-cluster job waits
for every slot. Bad gpus_per_job values exit 2 naming the field, with nothing created."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, needs_sshd, wait_until

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}

pytestmark = [needs_sshd, pytest.mark.e2e]


def _task(d: Path, name: str, marks: Path, gpus_per_job: int | None) -> Path:
    """A job that records the CUDA_VISIBLE_DEVICES it saw and when it ran ($JOB-start,
    $JOB-end), and runs until marks/gate-$JOB exists."""
    share = f", gpus_per_job: {gpus_per_job}" if gpus_per_job is not None else ""
    p = d / f"{name}.yaml"
    p.write_text(
        f"name: {name}\nnum_nodes: 1\n"
        f"resources: {{provider: local, local: {{gpus: 2}}{share}}}\nstop_grace: 2\nrun: |\n"
        f'  echo "[${{CUDA_VISIBLE_DEVICES-unset}}] $(date +%s.%N)" > {marks}/$JOB-start\n'
        f"  while [ ! -e {marks}/gate-$JOB ]; do sleep 0.1; done\n"
        f"  date +%s.%N > {marks}/$JOB-end\n")
    return p


def _queue(cli: CLI, name: str) -> dict[str, dict[str, Any]]:
    r = cli.run("queue", name, "--json")
    assert r.returncode == 0, r.stderr
    return {x["id"]: x for x in json.loads(r.stdout)}


def _launch(cli: CLI, task: Path, job: str) -> str:
    r = cli.run("launch", str(task), "-c", "s", "-y", "-d", "--env", f"JOB={job}", **FAST)
    assert r.returncode == 0, r.stderr
    return re.findall(r"\d{8}-\d{6}-[0-9a-f]{6}", r.stderr.split("Running job", 1)[1])[0]


def _seen(marks: Path, job: str) -> tuple[str, float]:
    devices, at = (marks / f"{job}-start").read_text().split()
    return devices.strip("[]"), float(at)


def _end(marks: Path, job: str) -> float:
    return float((marks / f"{job}-end").read_text())


def test_slots_pack_jobs_pin_gpus_and_free_them(cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    one = _task(tmp_path, "one", marks, 1)
    ids = {j: _launch(cli, one, j) for j in ("j1", "j2", "j3", "j4")}
    assert wait_until(lambda: all((marks / f"{j}-start").exists() for j in ("j1", "j2")), 60)
    assert {_seen(marks, "j1")[0], _seen(marks, "j2")[0]} == {"0", "1"}   # two at once
    recs = _queue(cli, "s")
    assert [recs[ids[j]]["state"] for j in ("j1", "j2", "j3", "j4")] == \
        ["running", "running", "queued", "queued"]
    assert recs[ids["j1"]]["held"] == [int(_seen(marks, "j1")[0])]
    assert recs[ids["j3"]]["held"] == [] and recs[ids["j3"]]["gpus"] == 1
    table = cli.run("queue", "s")
    assert table.returncode == 0 and "GPUS" in table.stdout, table.stderr
    row = next(ln for ln in table.stdout.splitlines() if ids["j1"] in ln)
    assert f" {_seen(marks, 'j1')[0]} " in row and "running" in row, table.stdout
    assert "wants 1" in next(ln for ln in table.stdout.splitlines() if ids["j3"] in ln)
    assert not (marks / "j3-start").exists()

    # j1 ends: j3 takes its slot.
    (marks / "gate-j1").write_text("")
    assert wait_until(lambda: (marks / "j3-start").exists(), 30)
    assert _seen(marks, "j3")[0] == _seen(marks, "j1")[0]
    assert _seen(marks, "j3")[1] >= _end(marks, "j1")
    print(f"the next job started {_seen(marks, 'j3')[1] - _end(marks, 'j1'):.2f} s after one ended")
    assert not (marks / "j4-start").exists()

    # A whole-cluster job queued behind them waits for every slot.
    whole = _task(tmp_path, "whole", marks, None)
    w_id = _launch(cli, whole, "w")

    # cancel of the running j2 frees its slot for j4 (the one waiting first).
    r = cli.run("cancel", "s", ids["j2"])
    assert r.returncode == 0 and "stopped on every node" in r.stderr, r.stderr
    assert wait_until(lambda: (marks / "j4-start").exists(), 30)
    assert _seen(marks, "j4")[0] == _seen(marks, "j2")[0]
    recs = _queue(cli, "s")
    assert recs[ids["j2"]]["state"] == "cancelled" and recs[ids["j2"]]["held"] == []
    assert recs[w_id]["state"] == "queued" and recs[w_id]["gpus"] is None

    (marks / "gate-j3").write_text("")
    assert wait_until(lambda: _queue(cli, "s")[ids["j3"]]["state"] == "succeeded", 30)
    assert not (marks / "w-start").exists()        # j4 still holds a slot
    assert _queue(cli, "s")[w_id]["state"] == "queued"
    (marks / "gate-j4").write_text("")
    assert wait_until(lambda: (marks / "w-start").exists(), 30)
    devices, w_at = _seen(marks, "w")
    assert devices == "unset" and w_at >= _end(marks, "j4")   # the whole node, as before
    assert _queue(cli, "s")[w_id]["held"] == [0, 1]
    (marks / "gate-w").write_text("")
    assert wait_until(lambda: _queue(cli, "s")[w_id]["state"] == "succeeded", 30)
    assert all(x["held"] == [] for x in _queue(cli, "s").values())


@pytest.mark.parametrize("value", ["3", "0", "-1"])
def test_bad_gpus_per_job_exits_2_naming_the_field(cli: CLI, tmp_path: Path, value: str) -> None:
    task = tmp_path / "bad.yaml"
    task.write_text("name: bad\nresources: {provider: local, local: {gpus: 2}, "
                    f"gpus_per_job: {value}}}\nrun: echo never\n")
    r = cli.run("launch", str(task), "-c", "b", "-y", "-d")
    assert r.returncode == 2 and "gpus_per_job" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert cli.status() == []


def test_gpus_per_job_above_an_existing_nodes_slots_is_refused(cli: CLI, tmp_path: Path) -> None:
    # A cluster whose node has 1 slot (none declared); the task file says nothing to check
    # against, so the node's queue refuses: exit 2 naming the field, nothing runs.
    marks = tmp_path / "marks"
    marks.mkdir()
    task = tmp_path / "t.yaml"
    task.write_text(f"name: t\nresources: {{provider: local, gpus_per_job: 2}}\n"
                    f"run: touch {marks}/ran\n")
    r = cli.run("up", str(task), "-c", "e", "-y")
    assert r.returncode == 0, r.stderr
    for detach in (["-d"], []):
        r = cli.run("launch", str(task), "-c", "e", "-y", *detach, **FAST)
        assert r.returncode == 2 and "gpus_per_job" in r.stderr, (detach, r.stderr)
        assert "1 GPU slot" in r.stderr, r.stderr
    assert not (marks / "ran").exists()
    assert all(x["state"] != "running" for x in _queue(cli, "e").values())
