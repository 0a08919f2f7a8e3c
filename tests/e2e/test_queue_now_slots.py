"""``launch --now`` honours free GPU slots (docs/queue.md), through the real CLI on one local
node with 2 declared slots: a ``gpus_per_job: 1`` job starts at once beside a running one
when a slot is free; it is refused (exit 2, nothing queued) once every slot is held or a job
waits; a whole-cluster job is refused while any job runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, wait_until

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}

pytestmark = [needs_sshd, pytest.mark.e2e]


def task(d: Path, name: str, marks: Path, gpus_per_job: int | None) -> Path:
    """A job that records the CUDA_VISIBLE_DEVICES it saw, then runs until marks/gate-$JOB
    exists (JOB=quick: it ends at once)."""
    share = f", gpus_per_job: {gpus_per_job}" if gpus_per_job is not None else ""
    p = d / f"{name}.yaml"
    p.write_text(
        f"name: {name}\nnum_nodes: 1\n"
        f"resources: {{provider: local, local: {{gpus: 2}}{share}}}\nstop_grace: 2\nrun: |\n"
        f'  echo "${{CUDA_VISIBLE_DEVICES-unset}}" > {marks}/$JOB-start\n'
        f'  [ "$JOB" = quick ] && exit 0\n'
        f"  while [ ! -e {marks}/gate-$JOB ]; do sleep 0.1; done\n")
    return p


def launch(cli: CLI, t: Path, job: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return cli.run("launch", str(t), "-c", "s", "-y", "--env", f"JOB={job}", *extra, **FAST)


def queued(cli: CLI) -> list[str]:
    r = cli.run("queue", "s", "--json")
    assert r.returncode == 0, r.stderr
    return [x["state"] for x in json.loads(r.stdout)]


def test_now_starts_a_slot_job_beside_a_running_one_and_refuses_when_none_is_free(
        cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    one, whole = task(tmp_path, "one", marks, 1), task(tmp_path, "whole", marks, None)
    assert launch(cli, one, "a", "-d").returncode == 0
    assert wait_until(lambda: (marks / "a-start").exists(), 60)

    # one slot of two is held: a 1-slot job starts now, on the other slot, and ends
    r = launch(cli, one, "quick", "--now")
    assert r.returncode == 0, r.stdout + r.stderr
    held = (marks / "a-start").read_text().strip()
    assert (marks / "quick-start").read_text().strip() == {"0": "1", "1": "0"}[held]

    # a whole-cluster job needs every slot: refused while a job runs, nothing queued
    r = launch(cli, whole, "w", "--now")
    assert r.returncode == 2 and "--now" in r.stderr and "busy" in r.stderr, r.stderr
    assert "gpus_per_job" not in r.stderr

    # both slots held: the 1-slot job is refused too, naming the slots
    assert launch(cli, one, "b", "-d").returncode == 0
    assert wait_until(lambda: (marks / "b-start").exists(), 60)
    r = launch(cli, one, "c", "--now")
    assert r.returncode == 2 and "has 0 free GPU slot(s) of 2" in r.stderr, r.stderr
    assert queued(cli).count("queued") == 0 and not (marks / "c-start").exists()

    # a job waits (c queued behind a and b): a free slot does not let --now jump it
    assert launch(cli, one, "c", "-d").returncode == 0
    (marks / "gate-a").write_text("")
    assert wait_until(lambda: (marks / "c-start").exists(), 60)
    assert launch(cli, whole, "d", "-d").returncode == 0        # waits for every slot
    (marks / "gate-b").write_text("")                           # a slot is free, d still waits
    assert wait_until(lambda: queued(cli).count("running") == 1, 60)
    r = launch(cli, one, "e", "--now")
    assert r.returncode == 2 and "a job waits on node 0" in r.stderr, r.stderr
    assert not (marks / "e-start").exists()
    for j in ("c", "d"):
        (marks / f"gate-{j}").write_text("")
    assert cli.run("down", "s", "-y").returncode == 0
