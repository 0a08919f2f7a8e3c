"""Recovery (issue 13, docs/recovery.md) through the real CLI on local nodes: the local
"cloud" takes node 1 (its sshd and processes are killed) mid-run; ``launch --recover``
replaces it and the job resumes from its checkpoint, ending with the same steps and data
order as an uninterrupted run; an SSH drop while the node runs is no loss; a launch out of
recoveries fails clearly."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, processes_with, wait_until
from recovery_job import (STEPS, recoveries, resumed_steps, sshd_processes, take,
                          uninterrupted_order, wait_or_fail, write_job)
from recovery_job import order as home_order

pytestmark = [needs_sshd, pytest.mark.e2e]


def _task(d: Path, name: str, recovery: str = "{poll_seconds: 1, max_recoveries: 1}") -> Path:
    write_job(d / "proj")
    p = d / f"{name}.yaml"
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local}}\nworkdir: proj\n"
                 f"stop_grace: 5\nrecovery: {recovery}\nrun: python steps.py\n")
    return p


def _node(cli: CLI, name: str, rank: int) -> Path:
    return cli.home / "clusters" / name / "local" / "nodes" / str(rank)


def _order(cli: CLI, name: str) -> list[str]:
    return home_order(_node(cli, name, 0) / "root")


def _take(cli: CLI, name: str, rank: int) -> None:
    """The local 'preemption': the node's sshd and everything under it die at once."""
    take(_node(cli, name, rank))


def _recoveries(cli: CLI, name: str) -> list[dict[str, object]]:
    return recoveries(cli.run, name)


def test_lost_node_is_replaced_and_the_job_resumes_with_the_same_steps_and_order(
        cli: CLI, tmp_path: Path) -> None:
    ref = cli.run("launch", str(_task(tmp_path, "plain")), "-y", "--recover", timeout=240,
                  CLOUDTRAIN_NODE_TIMEOUT="20")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    expected = _order(cli, "plain")
    assert len(expected) == STEPS
    assert expected == uninterrupted_order()     # what the cloud tests compare with

    proc = cli.popen("launch", str(_task(tmp_path, "rec")), "-y", "--recover",
                     CLOUDTRAIN_NODE_TIMEOUT="20")
    assert wait_until(lambda: len(_order(cli, "rec")) >= 10, 120), "the job did not train"
    old_key = (_node(cli, "rec", 1) / "ssh_host_ed25519_key.pub").read_text()
    _take(cli, "rec", 1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    text = out + err
    assert "the cloud took node 1: sshd exited (the local 'cloud' took the node)" in text, text
    assert "Recovered: job" in text
    resumed = resumed_steps(text)
    assert resumed[0] == 0 and len(resumed) == 2 and resumed[1] >= 10, resumed
    assert _order(cli, "rec") == expected            # same final step, same data order
    # A fresh node in rank 1: a new host key, pinned afresh (the job's SSH worked with it).
    assert (_node(cli, "rec", 1) / "ssh_host_ed25519_key.pub").read_text() != old_key

    recs = _recoveries(cli, "rec")
    assert len(recs) == 1, recs
    r = recs[0]
    assert r["ranks"] == [1] and "sshd exited" in str(r["reason"]) and r["status"] == "RECOVERED"
    for k in ("detect_s", "replace_s", "bootstrap_s", "sync_s", "restart_s"):
        assert isinstance(r[k], float) and r[k] >= 0, (k, r)
    assert _recoveries(cli, "plain") == []
    st = cli.run("status", "rec")
    assert st.returncode == 0 and "recovery" in st.stdout.lower(), st.stdout


def _freeze(cli: CLI, name: str, rank: int) -> list[int]:
    """Node ``rank`` stops answering SSH (its listening sshd and the CLI's sessions to it are
    SIGSTOPped: no RST, no FIN) while its job's processes run on: what the CLI meets when a
    node is overloaded or its network stalls, while the cloud still says it runs."""
    sshds = sshd_processes(_node(cli, name, rank))
    assert len(sshds) >= 2, sshds     # the listener and the job's session at least
    for p in sshds:
        os.kill(p, signal.SIGSTOP)
    return sshds


def _thaw(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_an_ssh_outage_longer_than_the_node_timeout_is_not_a_loss(
        cli: CLI, tmp_path: Path) -> None:
    """Issue 21: node 1's SSH is silent for more than CLOUDTRAIN_NODE_TIMEOUT while the
    (local) cloud says it runs: under --recover the job is not stopped, the CLI reconnects
    and node 1's log resumes; no recovery. (Without --recover the same outage ends the
    launch: tests/e2e/test_connections.py::test_silent_node_is_named_not_waited_for.)"""
    proc = cli.popen("launch", str(_task(tmp_path, "drop")), "-y", "--recover",
                     CLOUDTRAIN_NODE_TIMEOUT="4")
    assert wait_until(lambda: len(_order(cli, "drop")) >= 6, 120), "the job did not train"
    frozen = _freeze(cli, "drop", 1)
    try:
        time.sleep(12)               # three node timeouts, twelve polls
        assert proc.poll() is None, "the launch ended during the outage"
        assert processes_with(f"HOME={_node(cli, 'drop', 1) / 'root'}"), "node 1's job ended"
    finally:
        _thaw(frozen)
    out, err = proc.communicate(timeout=240)
    text = out + err
    assert proc.returncode == 0, text
    assert "node 1" in text and "reconnecting (gives up after 600 s" in text, text
    assert "rank 1 done at step 40" in text, text      # node 1's log resumed to its end
    assert "the cloud took" not in text and "unresponsive" not in text, text
    assert _order(cli, "drop") == uninterrupted_order()
    assert _recoveries(cli, "drop") == []


def test_a_node_silent_past_the_window_is_replaced_as_unresponsive(
        cli: CLI, tmp_path: Path) -> None:
    """Issue 21: the head stays silent on SSH past CLOUDTRAIN_UNRESPONSIVE_WINDOW while the
    cloud says it runs: it is replaced, the ledger says "unresponsive" and, the task having
    no checkpoints: (warned before anything started), "restarted from step 0"."""
    task = _task(tmp_path, "mute")
    proc = cli.popen("launch", str(task), "-y", "--recover", CLOUDTRAIN_NODE_TIMEOUT="4",
                     CLOUDTRAIN_UNRESPONSIVE_WINDOW="8")
    assert wait_until(lambda: len(_order(cli, "mute")) >= 6, 120), "the job did not train"
    old_head = set(processes_with(f"HOME={_node(cli, 'mute', 0) / 'root'}"))
    frozen = _freeze(cli, "mute", 0)
    old_head -= set(frozen)
    assert old_head, "the head's job is not found"
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        _thaw(frozen)
    text = out + err
    assert proc.returncode == 0, text
    warning = ("--recover without 'checkpoints:' in the task: after a replacement the job "
               "restarts from step 0")
    assert warning in err and err.index(warning) < err.index("Provisioning"), err
    assert "node 0 has not answered SSH for 8 s" in err, err
    assert "the cloud took" not in text, text
    assert resumed_steps(text) == [0, 0], text      # the head's disk went with it
    assert _order(cli, "mute") == uninterrupted_order()
    assert not [p for p in old_head if Path(f"/proc/{p}").exists()], "the old head's job runs"
    [r] = _recoveries(cli, "mute")
    assert r["ranks"] == [0] and r["status"] == "RECOVERED", r
    assert str(r["reason"]).startswith("node 0: unresponsive (no SSH answer for "), r
    assert "while the cloud reported it running" in str(r["reason"]), r
    assert r["resumed_from"] == "restarted from step 0", r
    assert isinstance(r["detect_s"], float) and r["detect_s"] >= 8, r   # the window waited
    st = cli.run("status", "mute")
    assert "unresponsive" in st.stdout and "restarted from step 0" in st.stdout, st.stdout


def test_out_of_recoveries_fails_clearly(cli: CLI, tmp_path: Path) -> None:
    proc = cli.popen("launch", str(_task(tmp_path, "max", "{poll_seconds: 1, max_recoveries: 0}")),
                     "-y", "--recover", CLOUDTRAIN_NODE_TIMEOUT="20")
    assert wait_until(lambda: len(_order(cli, "max")) >= 6, 120), "the job did not train"
    _take(cli, "max", 1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out + err
    assert "max_recoveries" in err and "giving up" in err, err
    recs = _recoveries(cli, "max")
    assert [r["status"] for r in recs] == ["GAVE_UP"]


def _controllers(cli: CLI) -> list[dict[str, object]]:
    r = cli.run("jobs", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_detached_controller_is_listed_followed_and_cancelled(cli: CLI, tmp_path: Path) -> None:
    r = cli.run("launch", str(_task(tmp_path, "bg")), "-y", "-d", "--recover")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--recover without 'checkpoints:' in the task" in r.stderr, r.stderr  # here, not in a log
    [c] = _controllers(cli)
    assert c["state"] == "running" and c["cluster"] == "bg"
    cid = str(c["id"])
    assert wait_until(lambda: len(_order(cli, "bg")) >= 6, 120), "the job did not train"
    listed = cli.run("jobs")
    assert cid in listed.stdout and "running" in listed.stdout, listed.stdout
    logs = cli.run("jobs", "logs", cid)
    assert "rank 0 resumed from step 0" in logs.stdout, logs.stdout
    done = cli.run("jobs", "cancel", cid, timeout=120)
    assert done.returncode == 0 and "cancelled" in done.stdout + done.stderr, done.stderr
    assert _controllers(cli)[0]["state"] == "cancelled"
    assert not processes_with("python steps.py"), "the job still runs on a node"
    followed = cli.run("jobs", "logs", cid, "-f", timeout=30)   # ended: returns at once
    assert followed.returncode == 0 and "Interrupted" in followed.stdout, followed.stdout
    for bad in ("nope", "../x", "20261124-030512-a1b2c3"):
        r = cli.run("jobs", "logs", bad)
        assert r.returncode == 2 and "error:" in r.stderr, (bad, r.stderr)


def test_a_killed_controller_leaves_the_guard_policy_in_force(cli: CLI, tmp_path: Path) -> None:
    fast = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}
    r = cli.run("launch", str(_task(tmp_path, "dies")), "-y", "-d", "--recover", "--down",
                **fast)
    assert r.returncode == 0, r.stdout + r.stderr
    [c] = _controllers(cli)
    assert wait_until(lambda: len(_order(cli, "dies")) >= 4, 120), "the job did not train"
    os.kill(int(str(c["pid"])), signal.SIGKILL)
    assert wait_until(lambda: _controllers(cli)[0]["state"] == "controller-died", 10)
    assert "controller died" in cli.run("jobs").stdout
    # The job ends on its own; the nodes' guards (job end, --down) stop them: nothing bills.
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/dies/"), 120), \
        "the nodes did not stop themselves"


def test_the_survivors_of_a_down_launch_wait_for_the_replacement(cli: CLI, tmp_path: Path) -> None:
    """launch --recover --down: the loss stops the job on the survivors, which is no job end
    of a --down job: their guards hold its rule while the CLI replaces the lost node (they
    went down under it before: the loss's stop ended the job, the grace ran out during the
    replacement), and the restarted job takes the rule over (status names it alone)."""
    go = tmp_path / "go"
    p = _task(tmp_path, "hold")
    p.write_text(p.read_text().replace(
        "run: python steps.py", f"run: python steps.py && while [ ! -e {go} ]; do sleep 0.2; done"))
    fast = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "1",
            "CLOUDTRAIN_NODE_TIMEOUT": "20"}
    proc = cli.popen("launch", str(p), "-y", "--recover", "--down", **fast)
    try:
        wait_or_fail(proc, lambda: len(_order(cli, "hold")) >= 8, 120)
        _take(cli, "hold", 1)
        # The restarted job trained to its end and waits for the go: the recovery is done.
        wait_or_fail(proc, lambda: len(_order(cli, "hold")) >= STEPS
                     and len(_recoveries(cli, "hold")) == 1, 180, "no recovery")
        log = (_node(cli, "hold", 0) / "root" / ".cloudtrain" / "guard" / "guard.log").read_text()
        assert "stop:" not in log, log        # the survivor never stopped itself
        [rec] = _recoveries(cli, "hold")
        downs = [d["job"] for d in cli_rules(cli, "hold")["down_on_end"]]
        assert len(downs) == 1 and downs != [rec["old_job"]], (downs, rec)
        assert _order(cli, "hold") == uninterrupted_order()
        go.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "Recovered: job" in err, err
    assert not processes_with(f"{cli.home}/clusters/hold/"), "--down left the nodes up"


def cli_rules(cli: CLI, name: str) -> dict[str, object]:
    entry = [e for e in cli.status() if e["name"] == name]
    assert entry and entry[0]["rules"], cli.status()
    return entry[0]["rules"]  # type: ignore[no-any-return]
