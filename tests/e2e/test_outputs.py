"""Nothing of the user's is lost (issue 21), through the real CLI on local nodes: a detached
job's outputs come back with ``cloudtrain outputs``; ``down`` pulls the outputs never pulled
before it removes the nodes, or refuses (exit 2, naming --discard-outputs) when the nodes
do not answer; a cluster that stopped itself with outputs never pulled says so in ``status``
and in the ledger."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until
from recovery_job import sshd_processes, take

pytestmark = [needs_sshd, pytest.mark.e2e]

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}


def _project(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A task whose job writes a checkpoint ('step N', N from the STEP file it ships)."""
    proj = tmp_path / name
    proj.mkdir()
    (proj / "STEP").write_text("80\n")
    task = proj / "task.yaml"
    # With HOLD set, the job waits for that file, then writes step N + 80 and ends.
    task.write_text(f"name: {name}\nnum_nodes: 1\nworkdir: .\noutputs: [ckpt/]\nrun: |\n"
                    "  mkdir -p ckpt && echo \"step $(cat STEP)\" > ckpt/model.pt\n"
                    "  if [ -n \"$HOLD\" ]; then until [ -e \"$HOLD\" ]; do sleep 0.1; done\n"
                    "    echo \"step $(( $(cat STEP) + 80 ))\" > ckpt/model.pt; fi\n")
    return proj, task


def _checkpoint(proj: Path) -> str:
    return (proj / "cloudtrain-outputs" / "ckpt" / "model.pt").read_text().strip()


def _detached(cli: CLI, task: Path, name: str, *flags: str, **env: str) -> str:
    r = cli.run("launch", str(task), "-y", "-d", *flags, **env)
    assert r.returncode == 0, r.stderr
    if "--down" not in flags:
        f = cli.run("logs", name, "--follow")       # returns once the job has ended
        assert f.returncode == 0, f.stderr
    return r.stderr


def test_outputs_command_and_down_pull_what_a_detached_job_wrote(cli: CLI, tmp_path: Path) -> None:
    proj, task = _project(tmp_path, "outs")
    said = _detached(cli, task, "outs")
    assert "'cloudtrain outputs outs' pulls them" in said, said
    assert not (proj / "cloudtrain-outputs").exists()       # -d: nothing pulled yet
    r = cli.run("outputs", "outs")
    assert r.returncode == 0, r.stderr
    assert _checkpoint(proj) == "step 80"

    for args, named in ((("outs", "--job", "nope"), "--job nope"), (("nope",), "nope")):
        bad = cli.run("outputs", *args)
        assert bad.returncode == 2 and named in bad.stderr and "Traceback" not in bad.stderr

    # A second detached job, pulled while it runs: what it wrote so far comes back, and its
    # outputs are not marked pulled (it writes more). down pulls them before the nodes go.
    (proj / "STEP").write_text("160\n")
    hold = tmp_path / "hold"
    r = cli.run("launch", str(task), "-y", "-d", "--env", f"HOLD={hold}")
    assert r.returncode == 0, r.stderr
    on_node = cli.home / "clusters" / "outs" / "local" / "nodes" / "0" / "root" / "workdir"
    assert wait_until(lambda: "160" in (on_node / "ckpt" / "model.pt").read_text(), 30)
    now = cli.run("outputs", "outs")
    assert now.returncode == 0, now.stderr
    assert "has not ended" in now.stderr and _checkpoint(proj) == "step 160", now.stderr
    hold.touch()
    assert cli.run("logs", "outs", "--follow").returncode == 0
    d = cli.run("down", "outs", "-y")
    assert d.returncode == 0, d.stderr
    assert "never pulled" in d.stderr, d.stderr
    assert _checkpoint(proj) == "step 240"
    assert_nothing_left(cli.home)


def test_down_refuses_when_unpulled_outputs_cannot_be_pulled(cli: CLI, tmp_path: Path) -> None:
    proj, task = _project(tmp_path, "lost")
    _detached(cli, task, "lost")
    node = cli.home / "clusters" / "lost" / "local" / "nodes" / "0"
    sessions = sshd_processes(node)        # the node dies: its sshd, its sessions, its jobs
    take(node)
    for p in sessions:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_until(lambda: not sshd_processes(node), 10)
    # The nodes are given 15 s to answer. -y (the form the tests' teardown uses, -a -y) asks
    # nothing and never means "discard".
    d = cli.run("down", "-a", "-y", timeout=120)
    assert d.returncode == 2, d.stderr
    assert "never pulled" in d.stderr and "--discard-outputs" in d.stderr, d.stderr
    assert [c["name"] for c in cli.status()] == ["lost"]       # nothing torn down
    d = cli.run("down", "lost", "-y", "--discard-outputs")
    assert d.returncode == 0, d.stderr
    assert re.search(r"outputs of job \S+ were not pulled", d.stderr), d.stderr
    assert cli.status() == []
    assert not (proj / "cloudtrain-outputs").exists()
    assert_nothing_left(cli.home)


def test_a_cluster_that_stopped_itself_says_its_outputs_were_not_pulled(
        cli: CLI, tmp_path: Path) -> None:
    _, task = _project(tmp_path, "gone")
    _detached(cli, task, "gone", "--down", **FAST)
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/gone/"), 60), \
        "the nodes did not stop themselves"
    st = cli.run("status", "--refresh")
    assert st.returncode == 0, st.stderr
    line = next(ln for ln in st.stdout.splitlines() if ln.startswith("gone:"))
    assert "GONE" in line and re.search(r"outputs of job \S+ were not pulled", line), line
    rep = cli.run("cost-report", "--json")
    assert rep.returncode == 0, rep.stderr
    ended = [c for c in json.loads(rep.stdout)["clusters"] if c["name"] == "gone"]
    assert re.search(r"outputs of job \S+ were not pulled", ended[0]["end_reason"]), ended
    assert_nothing_left(cli.home)
