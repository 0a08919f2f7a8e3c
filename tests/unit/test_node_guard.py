"""The node guard's decisions (cloudtrain/node/guard.py), in-process: each policy fires at its
limit and not before, and the guard is standard library only."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from cloudtrain.node import guard
from cloudtrain.pipeline.guard import guard_source

NOW = 1_800_000_000.0


def _job(root: Path, job_id: str, *, pid: int | None, rc: int | None = None) -> None:
    d = root / "jobs" / job_id
    d.mkdir(parents=True)
    if pid is not None:
        (d / "pid").write_text(str(pid))
    if rc is not None:
        (d / "rc").write_text(str(rc))


def test_idle_counts_from_the_later_of_busy_and_lease(tmp_path: Path) -> None:
    pol = {"idle_minutes": 1, "self_stop": "true", "lease_at": NOW - 600}
    # Busy 30 s ago, lease 90 s ago: not yet.
    assert guard.decide(str(tmp_path), pol, NOW, NOW - 30, NOW - 90, False)[0] is None
    # Both over a minute ago: idle.
    reason, seen = guard.decide(str(tmp_path), pol, NOW, NOW - 61, NOW - 90, False)
    assert reason == "idle" and seen["idle_for_s"] == 61
    # Busy now: never idle. A fresh lease (a CLI contact) postpones it.
    assert guard.decide(str(tmp_path), pol, NOW, NOW - 600, NOW - 600, True)[0] is None
    assert guard.decide(str(tmp_path), pol, NOW, NOW - 600, NOW - 10, False)[0] is None
    # Off, or no self-stop (machines cloudtrain does not own): never.
    assert guard.decide(str(tmp_path), dict(pol, idle_minutes=None), NOW, 0, 0, False)[0] is None
    assert guard.decide(str(tmp_path), dict(pol, self_stop=None), NOW, 0, 0, False)[0] is None


def test_budget_from_the_spend_at_launch_and_the_price(tmp_path: Path) -> None:
    # $3.6/h for the cluster: $0.001 a second; $1 spent at NOW-100; limit $1.2 -> at NOW+100.
    pol = {"max_cost_usd": 1.2, "cluster_hourly_usd": 3.6, "spent_usd": 1.0, "spent_at": NOW - 100}
    assert guard.decide(str(tmp_path), pol, NOW + 99, NOW, NOW, True)[0] is None
    reason, seen = guard.decide(str(tmp_path), pol, NOW + 100.5, NOW, NOW, True)
    assert reason == "budget" and seen["spent_usd"] == pytest.approx(1.2005)
    # An attached CLI watches it itself: the node waits budget_grace_s more.
    late = dict(pol, budget_grace_s=60)
    assert guard.decide(str(tmp_path), late, NOW + 150, NOW, NOW, True)[0] is None
    assert guard.decide(str(tmp_path), late, NOW + 161, NOW, NOW, True)[0] == "budget"


def test_lifetime_and_job_end(tmp_path: Path) -> None:
    pol = {"max_hours": 1, "started_at": NOW - 3599}
    assert guard.decide(str(tmp_path), pol, NOW, NOW, NOW, True)[0] is None
    assert guard.decide(str(tmp_path), pol, NOW + 1, NOW, NOW, True)[0] == "lifetime"
    assert guard.lifetime_end(pol) == NOW + 1

    pol = {"down_on_end": ["j1"]}
    assert guard.decide(str(tmp_path), pol, NOW, NOW, NOW, False)[0] is None   # not started
    _job(tmp_path, "j1", pid=os.getpid())
    assert guard.decide(str(tmp_path), pol, NOW, NOW, NOW, True)[0] is None    # running
    assert [p for _, p in guard.running_jobs(str(tmp_path))] == [os.getpid()]
    (tmp_path / "jobs" / "j1" / "rc").write_text("1")                           # failed: ends too
    ended = (tmp_path / "jobs" / "j1" / "rc").stat().st_mtime
    assert guard.decide(str(tmp_path), pol, ended + 1, NOW, NOW, False)[0] == "job-end"
    late = dict(pol, followed={"j1": 300})        # followed by a CLI that never beat
    assert guard.decide(str(tmp_path), late, ended + 100, NOW, NOW, False)[0] is None
    assert guard.decide(str(tmp_path), late, ended + 301, NOW, NOW, False)[0] == "job-end"
    # A job id is one name under jobs/, never a path.
    assert guard.decide(str(tmp_path), {"down_on_end": ["../x"]}, NOW, 0, 0, False)[0] is None


def test_job_end_waits_for_the_queue_and_for_a_follower_that_is_there(tmp_path: Path) -> None:
    root = str(tmp_path)
    _job(tmp_path, "j1", pid=None, rc=0)
    ended = (tmp_path / "jobs" / "j1" / "rc").stat().st_mtime
    pol = {"down_on_end": ["j1"]}
    # A job queued after the --down job (running, or waiting with a live waiter) goes first.
    assert guard.decide(root, pol, ended + 1, NOW, NOW, True, True)[0] is None
    assert guard.decide(root, pol, ended + 1, NOW, NOW, True, False)[0] == "job-end"
    # An attached launch's job (followed, grace 300 s): the node waits while the CLI's
    # heartbeat is fresh, and acts 35 s after the last one (never before the job's end).
    pol = {"down_on_end": ["j1"], "followed": {"j1": 300}}
    beat = tmp_path / ".cloudtrain" / "guard" / "followers" / "j1"
    beat.parent.mkdir(parents=True)
    beat.touch()
    os.utime(beat, (ended - 100, ended - 100))
    assert guard.decide(root, pol, ended + 1, NOW, NOW, False)[0] == "job-end"   # CLI long gone
    os.utime(beat, (ended + 20, ended + 20))
    assert guard.job_end_stop_at(root, pol, "j1") == ended + 55
    assert guard.decide(root, pol, ended + 54, NOW, NOW, False)[0] is None
    assert guard.decide(root, pol, ended + 55, NOW, NOW, False)[0] == "job-end"
    os.utime(beat, (ended + 400, ended + 400))                 # a CLI there: at most the grace
    assert guard.job_end_stop_at(root, pol, "j1") == ended + 300
    # A --down job that never started (cancelled, or failed in the queue) has ended too.
    q = tmp_path / ".cloudtrain" / "queue"
    q.mkdir(parents=True)
    (q / "j2.json").write_text(json.dumps({"id": "j2", "state": "queued", "waiter": None}))
    assert guard.job_ended(root, "j2") is None
    (q / "j2.json").write_text(json.dumps({"id": "j2", "state": "failed", "ended_at": NOW}))
    assert guard.job_ended(root, "j2") == NOW


def test_a_job_a_recovery_stopped_stops_the_node_only_once_its_hold_ran_out(
        tmp_path: Path) -> None:
    """launch --recover --down: the loss's stop is no job end while the CLI replaces the lost
    node; a CLI gone mid-recovery leaves the survivors to go down at the hold's end."""
    from cloudtrain.pipeline import rules

    root = str(tmp_path)
    _job(tmp_path, "j1", pid=None, rc=143)
    ended = (tmp_path / "jobs" / "j1" / "rc").stat().st_mtime
    pol = {"down_on_end": ["j1"], **rules.held({"down_on_end": ["j1"]}, "j1", ended + 1800)}
    reason, seen = guard.decide(root, pol, ended + 1799, NOW, NOW, False)
    assert reason is None and seen["recovering_until"] == ended + 1800
    assert guard.decide(root, pol, ended + 1800, NOW, NOW, False)[0] == "job-end"
    # The restarted job supersedes it: its rules only (held or not, the old job is gone).
    asked = rules.LaunchRules("j2", None, "", False, True, 300.0, supersedes="j1")
    after = {**pol, **rules.compose(pol, asked)}
    assert after["down_on_end"] == ["j2"] and after["recovering"] == {}
    assert list(after["followed"]) == ["j2"]
    assert guard.decide(root, after, ended + 1800, NOW, NOW, False)[0] is None
    assert rules.held({"down_on_end": []}, "j1", NOW) == {}     # no --down job: nothing held


def test_a_down_job_whose_process_died_without_an_exit_code_stops_the_node(
        tmp_path: Path) -> None:
    # The sweep's driver (jobs/sweep-NAME/pid, no rc: it is not a ctjob.sh job) or a job
    # SIGKILLed before it wrote its rc: it has ended at the moment the guard looks. It used to
    # be "ended" at time.time(), always a little after the loop's now: the node never stopped.
    root = str(tmp_path)
    _job(tmp_path, "sweep-s", pid=2 ** 22 + 12345)              # no such process
    pol = {"down_on_end": ["sweep-s"]}
    assert guard.job_ended(root, "sweep-s", NOW) == NOW
    assert guard.decide(root, pol, NOW, NOW, NOW, False)[0] == "job-end"


def test_a_queued_job_counts_only_while_something_will_start_it(tmp_path: Path) -> None:
    q = tmp_path / ".cloudtrain" / "queue"
    q.mkdir(parents=True)

    def rec(job: str, **kw: object) -> None:
        (q / f"{job}.json").write_text(json.dumps(dict({"id": job, "state": "queued"}, **kw)))

    rec("live", waiter=os.getpid())
    rec("dead", waiter=2 ** 22 + 12345)          # no such process
    rec("submitting")                            # no waiter yet, a fresh file
    rec("stale")
    os.utime(q / "stale.json", (1_000_000.0, 1_000_000.0))     # written long ago
    # "dead" has no queue.py to adopt it here: it is simply not counted.
    assert guard.queued_jobs(str(tmp_path)) == 2


def test_the_stop_writes_stopped_json_then_runs_the_self_stop(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    monkeypatch.setattr(signal, "signal", lambda *a: None)   # the stop ignores SIGTERM/SIGHUP
    (tmp_path / ".cloudtrain" / "guard").mkdir(parents=True)
    out = tmp_path / "said"
    pol = {"rank": 1, "self_stop": f"cat {tmp_path}/.cloudtrain/guard/stopped.json > {out}; "
                                   f"echo \" $CT_GUARD_REASON\" >> {out}"}
    guard.stop(str(tmp_path), pol, "idle")
    said = out.read_text()
    assert said.endswith(" idle\n")
    assert json.loads(said.rsplit(" ", 1)[0])["reason"] == "idle"
    log = (tmp_path / ".cloudtrain" / "guard" / "guard.log").read_text()
    assert "stop: idle" in log and "self-stop" in log
    guard.stop(str(tmp_path), pol, "budget")            # once only
    assert out.read_text() == said


def test_the_guard_is_standard_library_only() -> None:
    """guard.py and sessions.py (shipped beside it) import the standard library and, guard.py,
    each other: nothing else exists on a node."""
    for path in (Path(guard.__file__), Path(guard.__file__).with_name("sessions.py")):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        tops = {n.split(".")[0] for n in names - {"cloudtrain.node.sessions", "sessions"}}
        assert tops - {"__future__"} <= set(sys.stdlib_module_names), (path.name, names)


def test_queue_run_submits_once_follows_and_says_when_a_job_waits(tmp_path: Path) -> None:
    """node/queue.py run, as the launch's one session per node runs it from the bootstrap
    bundle (ctjob.sh beside it): the framed script is submitted and followed; the same command
    again (a reconnect) submits nothing and follows from its offset; a job behind a running one
    says so (253) and is started by the node when its turn comes."""
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    shutil.copy(repo / "cloudtrain" / "node" / "queue.py", bundle / "queue.py")
    shutil.copy(repo / "bootstrap" / "ctjob.sh", bundle / "ctjob.sh")
    root = tmp_path / "root"

    def run(job: str, at: str, body: str, offset: int = 0) -> subprocess.CompletedProcess[bytes]:
        script = body.encode()
        p = subprocess.Popen(
            [sys.executable, str(bundle / "queue.py"), "run", str(root), job, "me@here", at, "t",
             str(offset)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(os.environ, CT_QUEUE_POLL="0.05"))
        assert p.stdin is not None and p.stdout is not None and p.stderr is not None
        p.stdin.write(str(len(script)).encode() + b"\n" + script)
        p.stdin.flush()     # and held open, as the CLI's session holds it
        try:
            code = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        return subprocess.CompletedProcess(p.args, code, p.stdout.read(), p.stderr.read())

    starts = tmp_path / "starts"
    first = run("a", "1", f"echo a >> {starts}\necho one\necho two\nexit 5\n")
    assert (first.returncode, first.stdout) == (5, b"one\ntwo\n"), first.stderr
    again = run("a", "1", "echo never\n", offset=4)
    assert (again.returncode, again.stdout) == (5, b"two\n"), again.stderr
    assert starts.read_text() == "a\n"

    gate = tmp_path / "gate"
    long = subprocess.Popen(
        [sys.executable, str(bundle / "queue.py"), "submit", str(root), "b", "me@here", "2", "t"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert long.communicate(f"while [ ! -e {gate} ]; do sleep 0.05; done\n".encode(),
                            timeout=30)[0].startswith(b"::started ")
    waits = run("c", "3", "echo c-ran\n")
    assert waits.returncode == 253 and b"::ctjob queued 1 b" in waits.stderr, waits.stderr
    gate.touch()
    import time

    deadline = time.monotonic() + 30
    while not (root / "jobs" / "c" / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    follow = subprocess.Popen(["bash", str(bundle / "ctjob.sh"), str(root / "jobs" / "c"),
                               "--follow", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:   # stdin held open, as the CLI's session holds it
        assert follow.wait(timeout=30) == 0
        assert follow.stdout is not None and follow.stdout.read() == b"c-ran\n"
    finally:
        if follow.poll() is None:
            follow.kill()


def test_ctguard_starts_the_guard_on_a_fresh_node_once_and_renews_the_lease(tmp_path: Path) -> None:
    """ctguard.sh on a node that never had a guard (no pid files yet): it starts one, says so,
    and a second contact renews the lease without starting another; policy, guard.py and
    sessions.py are written. (A contact that died on the missing pid files left every new cluster unguarded.)"""
    import subprocess
    import time

    script = Path(__file__).resolve().parents[2] / "bootstrap" / "ctguard.sh"
    root = tmp_path / "node"
    src = guard_source()
    env = dict(os.environ, CT_GUARD_NO_SYSTEMD="1", CT_GUARD_POLL="0.2")

    def contact(mode: str, *extra: str) -> str:
        r = subprocess.run(["bash", str(script), str(root), sys.executable, "ctguard-unit", "0",
                            mode, *extra], input=src, capture_output=True, env=env, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.decode()

    d = root / ".cloudtrain" / "guard"
    try:
        assert "::guard process" in contact("install", json.dumps({"idle_minutes": None}))
        assert (d / "guard.py").read_bytes() + b"\0" + (d / "sessions.py").read_bytes() == src
        assert json.loads((d / "policy.json").read_text()) == {"idle_minutes": None}
        deadline = time.monotonic() + 10
        while not ((d / "guard.pid").exists() and (d / "deadman.pid").exists()):
            assert time.monotonic() < deadline, "the guard did not start"
            time.sleep(0.05)
        first = {f: (d / f).read_text() for f in ("supervisor.pid", "deadman.pid")}
        lease = json.loads((d / "lease").read_text())["at"]
        assert abs(lease - time.time()) < 5
        assert "::guard process" in contact("touch")
        assert {f: (d / f).read_text() for f in first} == first   # nothing started twice
    finally:
        (d / "stopped.json").write_text("{}")
        for f in ("supervisor.pid", "guard.pid", "deadman.pid"):
            try:
                os.kill(int((d / f).read_text().split()[0]), 9)
            except (OSError, ValueError):
                pass


def test_contacts_at_once_each_ship_the_guard_without_tripping_on_each_other(
        tmp_path: Path) -> None:
    """Two launches on one cluster contact each node's guard at the same moment, each shipping
    guard.py: they wrote the same temporary file, and the second 'mv' failed ('cannot stat
    guard.py.tmp'), so that launch said the node guard failed (seen in CI)."""
    import subprocess
    import threading

    script = Path(__file__).resolve().parents[2] / "bootstrap" / "ctguard.sh"
    root = tmp_path / "node"
    d = root / ".cloudtrain" / "guard"
    d.mkdir(parents=True)
    (d / "stopped.json").write_text("{}")      # no guard process is started by these contacts
    env = dict(os.environ, CT_GUARD_NO_SYSTEMD="1")
    src = guard_source()
    failed = []
    for round_ in range(25):
        procs = [subprocess.Popen(["bash", str(script), str(root), sys.executable, "ctguard-unit",
                                   "0", "policy", json.dumps({"idle_minutes": None})],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=env)
                 for _ in range(4)]
        # Each ships a different guard.py (so each one writes it), all of them at once.
        errs: dict[int, bytes] = {}

        def feed(i: int, p: subprocess.Popen[bytes]) -> None:
            errs[i] = p.communicate(src.replace(b"\0", f"\n# {round_}-{i}\n\0".encode(), 1),
                                    timeout=30)[1]

        feeders = [threading.Thread(target=feed, args=(i, p)) for i, p in enumerate(procs)]
        for t in feeders:
            t.start()
        for t in feeders:
            t.join()
        failed += [errs[i].decode() for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, failed[:3]
    assert not list(d.glob("*.tmp*")), list(d.glob("*"))
