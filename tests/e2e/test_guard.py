"""The node guard through the real CLI on local nodes (docs/guard.md): the cluster stops
itself with no further command when the laptop is gone (launch --down, launch -d --down, a
budget with launch -d), when idle, and at its lifetime; a job or an SSH session keeps it
alive; a SIGKILLed guard comes back; autostop changes the policy live."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}

pytestmark = [needs_sshd, pytest.mark.e2e]


def _task(d: Path, name: str, run: str, extra: str = "", nodes: int = 2,
          resources: str = "{provider: local}") -> Path:
    p = d / f"{name}.yaml"
    body = "\n".join("  " + ln for ln in run.strip().splitlines())
    p.write_text(f"name: {name}\nnum_nodes: {nodes}\nresources: {resources}\n"
                 f"stop_grace: 5\nrun: |\n{body}\n{extra}")
    return p


def _gone(cli: CLI, name: str, timeout: float = 60, plain: str = "UP") -> dict[str, object]:
    """Wait until the nodes stopped themselves (no process of this home is left), then the
    next contact (status) shows the cluster gone; returns its status entry. ``plain``: what
    the plain (offline) status says before: PROBABLY_STOPPED where the recorded rules tell
    (idle after a known-idle contact, lifetime, budget), UP where only the nodes knew (a job's
    end nobody saw, sessions)."""
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/{name}/"), timeout), \
        "the nodes did not stop themselves"
    time.sleep(3)               # the CLI notices later than the nodes stopped
    noticed = time.time()
    (offline,) = [e for e in cli.status() if e["name"] == name]
    assert offline["status"] == plain, offline
    entries = _live(cli)
    gone = [e for e in entries if e["name"] == name]
    assert gone and gone[0]["status"] == "GONE", entries
    assert cli.status() == []           # forgotten: the next status lists nothing
    # The ledger stops counting when the nodes stopped, not when the CLI noticed.
    c = _ledger(cli, name)
    ended = datetime.fromisoformat(c["ended_at"]).timestamp()
    assert abs(ended - float(gone[0]["stopped_at"])) < 1.5, (c, gone)
    assert noticed - ended > 2.5, (c, noticed)
    if plain == "PROBABLY_STOPPED":
        assert offline["expected_stop_reason"] == gone[0]["reason"], offline
        assert abs(float(offline["expected_stop_at"]) - ended) < 3, (offline, c)
    return gone[0]


def _live(cli: CLI) -> list[dict[str, object]]:
    """``status --refresh --json``: the providers and the nodes asked (a plain status reads
    only the local state and what the last contact saw)."""
    r = cli.run("status", "--refresh", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _ledger(cli: CLI, name: str) -> dict[str, Any]:
    """The cost report's entry for the latest cluster called ``name``."""
    rep = cli.run("cost-report", "--json")
    assert rep.returncode == 0, rep.stderr
    return max((c for c in json.loads(rep.stdout)["clusters"] if c["name"] == name),
               key=lambda c: c["started_at"])


def _ledger_reason(cli: CLI, name: str) -> tuple[str, str, dict[str, Any]]:
    c = _ledger(cli, name)
    return c["end_reason"], c["status"], c


def test_lost_laptop_launch_down_the_job_completes_and_the_cluster_stops_itself(
        cli: CLI, tmp_path: Path) -> None:
    marks, started = tmp_path / "marks", tmp_path / "started"
    marks.mkdir()
    started.mkdir()
    task = _task(tmp_path, "lost", f"""
echo "running on $CLOUDTRAIN_NODE_RANK"
touch {started}/$CLOUDTRAIN_NODE_RANK
sleep 6
touch {marks}/done-$CLOUDTRAIN_NODE_RANK
""")
    proc = cli.popen("launch", str(task), "-y", "--down", **FAST)
    # The job runs on both nodes (not only the launch's earlier steps: killed then, the CLI
    # never started it, and the test read that as a job that did not complete).
    assert wait_until(lambda: len(list(started.iterdir())) == 2, 90)
    proc.send_signal(signal.SIGKILL)            # the laptop is gone
    proc.wait(timeout=10)
    assert wait_until(lambda: len(list(marks.iterdir())) == 2, 30), "the job did not complete"
    gone = _gone(cli, "lost")
    assert gone["reason"] == "job-end"
    assert_nothing_left(cli.home)
    reason, status, row = _ledger_reason(cli, "lost")
    assert (reason, status) == ("job-end", "terminated")


def test_detached_down_and_a_detached_budget_are_enforced_on_the_nodes(
        cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "det", "echo hello; sleep 2")
    r = cli.run("launch", str(task), "-y", "-d", "--down", **FAST)
    assert r.returncode == 0, r.stderr
    assert len(processes_with(f"{cli.home}/clusters/det/")) > 0      # returned; still up
    assert _gone(cli, "det")["reason"] == "job-end"
    assert _ledger_reason(cli, "det")[0] == "job-end"

    # A budget with -d: the guard SIGTERMs the job (it checkpoints in its grace), then stops.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    task = _task(tmp_path, "bud", f"""
trap 'echo step > {ckpt}/ckpt-$CLOUDTRAIN_NODE_RANK; exit 143' TERM
while :; do sleep 0.2; done
""", resources="{provider: local, local: {price_per_hour: 36}}")
    # 2 nodes at $36/h: $0.02 per second; a budget of $0.20 is reached ~10 s after up.
    r = cli.run("launch", str(task), "-y", "-d", "--max-cost", "0.2", "--hours", "0.0001", **FAST)
    assert r.returncode == 0, r.stderr
    gone = _gone(cli, "bud", timeout=90, plain="PROBABLY_STOPPED")
    assert gone["reason"] == "budget"
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-0", "ckpt-1"]
    reason, _, row = _ledger_reason(cli, "bud")
    assert reason == "budget"
    assert 0.18 <= row["cost_usd"] <= 0.3, row
    assert_nothing_left(cli.home)


def _spawn_ssh(cli: CLI, name: str) -> tuple[subprocess.Popen[bytes], int]:
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "ssh", name], stdin=slave,
                            stdout=slave, stderr=slave, env=cli.env(), start_new_session=True)
    os.close(slave)
    return proc, master


def test_idle_stop_and_what_keeps_a_cluster_alive(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "idle", "sleep 20", extra="autostop: {idle_minutes: 0.1}\n")
    # A running job keeps it alive past the idle limit (6 s).
    r = cli.run("launch", str(task), "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    time.sleep(9)
    (st,) = _live(cli)
    assert st["status"] == "UP" and st["guard"]["busy"] is True, st
    job = st["guard"]["busy_with"][0]
    assert job.startswith("job "), st["guard"]
    # The job alone: the launch's own SSH session, still closing on a loaded machine, may be
    # seen once as a session; it is gone at the guard's next look.
    seen: list[object] = [st["guard"]]

    def the_job_alone() -> bool:
        seen.append(g := _live(cli)[0]["guard"])
        return isinstance(g, dict) and g["words"] == f"busy: {job}"

    assert st["guard"]["words"] == f"busy: {job}" or wait_until(the_job_alone, 8, 0.5), seen
    assert st["autostop"]["idle_minutes"] == 0.1
    # An interactive 'cloudtrain ssh' session keeps it alive too.
    proc, master = _spawn_ssh(cli, "idle")
    try:
        time.sleep(14)          # the job ended ~5 s ago; idle would have fired by now
        (st,) = _live(cli)
        assert st["status"] == "UP" and st["guard"]["busy"] is True, st
        # on the head, the session with its terminal; its lease renewals are not sessions
        assert st["guard"]["words"] == "busy: 1 ssh session", st["guard"]
    finally:
        os.write(master, b"exit\n")
        proc.wait(timeout=20)
        os.close(master)
    assert _gone(cli, "idle", timeout=40)["reason"] == "idle"
    assert_nothing_left(cli.home)

    # 'up' alone, nothing run: gone after the idle limit.
    r = cli.run("up", str(task), "-y", "--no-bootstrap", **FAST)
    assert r.returncode == 0, r.stderr
    assert "autostop: tear down after 0.1 min idle" in r.stderr
    assert _gone(cli, "idle", timeout=40, plain="PROBABLY_STOPPED")["reason"] == "idle"
    assert _ledger_reason(cli, "idle")[0] == "idle"
    assert_nothing_left(cli.home)


def _guard_pids(cli: CLI, what: str) -> list[int]:
    """The node guard's processes of this home: ``what`` is run (the guard) or
    ctguard-supervisor (the loop that restarts it)."""
    found = []
    for p in processes_with(str(cli.home)):
        try:
            words = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (what == "run" and any(w.endswith(b"guard.py") for w in words) and b"run" in words) \
                or (what != "run" and what.encode() in words):
            found.append(p)
    return found


def test_a_sigkilled_guard_comes_back_and_the_lifetime_fires_without_it(
        cli: CLI, tmp_path: Path) -> None:
    # max_hours 0.006: the lifetime ends ~21.6 s after the cluster was created.
    task = _task(tmp_path, "life", "echo", extra="max_hours: 0.006\n", nodes=1)
    r = cli.run("up", str(task), "-y", "--no-bootstrap", **FAST)
    assert r.returncode == 0, r.stderr
    assert "lifetime 0.006 h" in r.stderr
    assert wait_until(lambda: len(_guard_pids(cli, "run")) == 1, 10)
    (first,) = _guard_pids(cli, "run")
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: _guard_pids(cli, "run") and _guard_pids(cli, "run") != [first], 10)
    # Now the guard and its supervisor both die: the deadman still ends the cluster.
    for p in _guard_pids(cli, "ctguard-supervisor") + _guard_pids(cli, "run"):
        os.kill(p, signal.SIGKILL)
    time.sleep(2)
    assert not _guard_pids(cli, "run")
    assert _gone(cli, "life", timeout=40, plain="PROBABLY_STOPPED")["reason"] == "lifetime"
    log = cli.run("cost-report", "--json")
    assert "lifetime" in log.stdout
    assert_nothing_left(cli.home)


def test_autostop_changes_the_policy_on_a_live_cluster(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "pol", "echo", nodes=2)
    r = cli.run("up", str(task), "-y", "--no-bootstrap", **FAST)
    assert r.returncode == 0, r.stderr
    assert "autostop: off" in r.stderr                  # local: off unless the task sets it
    (st,) = cli.status()
    assert st["autostop"]["idle_minutes"] is None
    r = cli.run("autostop", "pol", "--idle-minutes", "30", "--stop", **FAST)
    assert r.returncode == 0, r.stderr
    (st,) = cli.status()
    assert st["autostop"]["idle_minutes"] == 30 and st["autostop"]["down"] is False, st
    assert 29 < st["guard"]["stops_in_min"] <= 30, st
    for rank in (0, 1):         # every node's guard reads the new policy
        pol = json.loads((cli.home / "clusters" / "pol" / "local" / "nodes" / str(rank) / "root"
                          / ".cloudtrain" / "guard" / "policy.json").read_text())
        assert (pol["idle_minutes"], pol["down"], pol["rank"]) == (30, False, rank)
    # Every contact renews the lease: here status --refresh, then exec.
    lease = cli.home / "clusters" / "pol" / "local" / "nodes" / "1" / "root" / ".cloudtrain" \
        / "guard" / "lease"
    for contact in (["status", "--refresh"], ["exec", "pol", "--", "true"]):
        before = json.loads(lease.read_text())["at"]
        time.sleep(1.1)
        assert cli.run(*contact).returncode == 0
        assert json.loads(lease.read_text())["at"] > before, contact
    r = cli.run("logs", "pol", "--guard")
    assert r.returncode == 0 and '"idle_minutes": 30' in r.stdout, r.stdout + r.stderr
    # --stop: the nodes stop themselves; the cluster is kept as STOPPED, not torn down.
    r = cli.run("autostop", "pol", "--idle-minutes", "0.05", **FAST)
    assert r.returncode == 0, r.stderr
    # (waited for without a contact: each 'status --refresh' renews the lease)
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/pol/"), 40)
    time.sleep(1)
    # Offline: the last contacts saw it idle and autostop started nothing: not UP.
    (st,) = cli.status()
    assert (st["status"], st["expected_stop_reason"]) == ("PROBABLY_STOPPED", "idle"), st
    assert _live(cli)[0]["status"] == "STOPPED"
    r = cli.run("down", "pol", "-y")
    assert r.returncode == 0, r.stderr
    assert_nothing_left(cli.home)


@pytest.mark.parametrize("args, field", [
    (["--idle-minutes", "-1"], "--idle-minutes"),
    (["--idle-minutes", "nan"], "--idle-minutes"),
    (["--idle-minutes", "0"], "--idle-minutes"),
    (["--idle-minutes", "ten"], "--idle-minutes"),
    (["--off", "--idle-minutes", "3"], "--off"),
    ([], "--idle-minutes"),
])
def test_autostop_bad_input(cli: CLI, tmp_path: Path, args: list[str], field: str) -> None:
    r = cli.run("autostop", "nosuch", *args)
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr


def test_task_autostop_bad_input_creates_nothing(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "bad", "echo", extra="autostop: {idle_minutes: 0}\n")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 2 and "autostop.idle_minutes" in r.stderr, r.stderr
    task = _task(tmp_path, "bad", "echo", extra="autostop: sometimes\n")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 2 and "autostop" in r.stderr, r.stderr
    assert cli.status() == []
    assert_nothing_left(cli.home)
