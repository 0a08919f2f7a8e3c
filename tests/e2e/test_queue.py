"""The job queue through the real CLI on 2 local nodes (docs/queue.md): a launch on a busy
cluster waits its turn (attached, following; or -d, started by the nodes with no CLI), `queue`
lists the jobs with states, times and exit codes, `launch --now` refuses, `cancel` removes a
queued job and stops a running one within its stop_grace, and the guard's idle clock counts
queued work as busy."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}

pytestmark = [needs_sshd, pytest.mark.e2e]


def _task(d: Path, name: str, run: str, cluster_extra: str = "") -> Path:
    p = d / f"{name}.yaml"
    body = "\n".join("  " + ln for ln in run.strip().splitlines())
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local}}\n"
                 f"stop_grace: 5\n{cluster_extra}run: |\n{body}\n")
    return p


def _queue(cli: CLI, name: str) -> list[dict[str, Any]]:
    r = cli.run("queue", name, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _by_id(recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in recs}


def _job_id(text: str) -> str:
    found = re.findall(r"\d{8}-\d{6}-[0-9a-f]{6}", text)
    assert found, text
    return found[0]


def _stamp(marks: Path, what: str, rank: int) -> float:
    return float((marks / f"{what}-{rank}").read_text().split()[0])


def test_two_launches_wait_their_turn_and_queue_lists_them(cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    stamp = "date +%s.%N > {m}/{w}-$CLOUDTRAIN_NODE_RANK"
    first = _task(tmp_path, "first", f"""
{stamp.format(m=marks, w='a-start')}
sleep 20
{stamp.format(m=marks, w='a-end')}
""")
    second = _task(tmp_path, "second", f"""
{stamp.format(m=marks, w='b-start')}
echo "second says hi from $CLOUDTRAIN_NODE_RANK"
exit 5
""")
    third = _task(tmp_path, "third", f"""
{stamp.format(m=marks, w='c-start')}
echo "third ran"
""")
    r = cli.run("launch", str(first), "-c", "q", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    a_id = _job_id(r.stderr.split("Running job", 1)[1])
    assert wait_until(lambda: (marks / "a-start-0").exists(), 60)
    # An attached launch waits its turn, then follows its job and exits with its code.
    proc = cli.popen("launch", str(second), "-c", "q", "-y", **FAST)
    assert wait_until(lambda: len(_queue(cli, "q")) == 2, 60)
    # A detached one queued behind both: the nodes start it, not the laptop.
    r = cli.run("launch", str(third), "-c", "q", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    c_id = _job_id(r.stderr.split("Running job", 1)[1])
    assert f"Job {c_id} queued on every node" in r.stderr, r.stderr
    assert f"queued behind job {a_id} (position 2)" in r.stderr, r.stderr
    assert not (marks / "b-start-0").exists() and not (marks / "c-start-0").exists()
    states = [x["state"] for x in _queue(cli, "q")]
    assert states == ["running", "queued", "queued"], states
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, out + err
    assert f"queued behind job {a_id} (position 1)" in err, err
    assert "second says hi from 1" in out + err
    b_id = _job_id(err.split("Running job", 1)[1])
    assert wait_until(lambda: all((marks / f"c-start-{k}").exists() for k in (0, 1)), 60)
    for rank in (0, 1):     # on every node: each job after the one before it
        assert _stamp(marks, "a-end", rank) <= _stamp(marks, "b-start", rank)
        gap = _stamp(marks, "b-start", rank) - _stamp(marks, "a-end", rank)
        print(f"node {rank}: the next job started {gap:.2f} s after the first ended")
        assert _stamp(marks, "b-start", rank) <= _stamp(marks, "c-start", rank)
    assert wait_until(lambda: _queue(cli, "q")[-1]["state"] == "succeeded", 30)
    recs = _by_id(_queue(cli, "q"))
    assert [recs[i]["state"] for i in (a_id, b_id, c_id)] == ["succeeded", "failed", "succeeded"]
    assert [recs[i]["exit_code"] for i in (a_id, b_id, c_id)] == [0, 5, 0]
    assert recs[a_id]["duration_s"] >= 19.5 and recs[a_id]["task"] == "first"
    assert all("@" in r["submitter"] and r["submitted"] and r["started"] for r in recs.values())
    table = cli.run("queue", "q")
    assert table.returncode == 0 and "SUBMITTER" in table.stdout, table.stderr
    assert all(i in table.stdout for i in (a_id, b_id, c_id)), table.stdout
    a_row = next(ln for ln in table.stdout.splitlines() if ln.startswith(a_id))
    assert re.search(r"  \d+\.\d s  ", a_row), a_row   # DURATION with its unit (~20 s)
    # logs --job of a job that the nodes started from the queue
    logs = cli.run("logs", "q", "--job", c_id)
    assert logs.returncode == 0 and "third ran" in logs.stdout + logs.stderr, logs.stderr


def test_now_refuses_and_cancel_removes_queued_and_stops_running(cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    long = _task(tmp_path, "long", f"""
trap 'touch {marks}/long-term-$CLOUDTRAIN_NODE_RANK; sleep 1; exit 143' TERM
touch {marks}/long-$CLOUDTRAIN_NODE_RANK
sleep 60 &
wait
""")
    never = _task(tmp_path, "never", f"touch {marks}/never-$CLOUDTRAIN_NODE_RANK")
    after = _task(tmp_path, "after", f"touch {marks}/after-$CLOUDTRAIN_NODE_RANK")
    r = cli.run("launch", str(long), "-c", "c", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    long_id = _job_id(r.stderr.split("Running job", 1)[1])
    assert wait_until(lambda: all((marks / f"long-{k}").exists() for k in (0, 1)), 60)

    r = cli.run("launch", str(never), "-c", "c", "-y", "--now", **FAST)
    assert r.returncode == 2 and long_id in r.stderr and "--now" in r.stderr, r.stderr
    assert [x["id"] for x in _queue(cli, "c")] == [long_id]      # nothing queued
    # --recover runs the same chain: its --now refuses too (before issue 22 it was ignored)
    r = cli.run("launch", str(never), "-c", "c", "-y", "--now", "--recover", **FAST)
    assert r.returncode == 2 and long_id in r.stderr and "--now" in r.stderr, r.stderr
    assert [x["id"] for x in _queue(cli, "c")] == [long_id]

    r = cli.run("launch", str(never), "-c", "c", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    never_id = _job_id(r.stderr.split("Running job", 1)[1])
    r = cli.run("launch", str(after), "-c", "c", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    after_id = _job_id(r.stderr.split("Running job", 1)[1])

    for bad in (["c", "nope"], ["c"], ["c", never_id, "--all"], ["c", "20200101-000000-abcdef"]):
        r = cli.run("cancel", *bad)
        assert r.returncode == 2 and ("JOB_ID" in r.stderr or "--all" in r.stderr), (bad, r.stderr)

    r = cli.run("cancel", "c", never_id)
    assert r.returncode == 0 and "removed from the queue" in r.stderr, r.stderr
    t0 = time.monotonic()
    r = cli.run("cancel", "c", long_id)
    took = time.monotonic() - t0
    assert r.returncode == 0 and "stopped on every node" in r.stderr, r.stderr
    print(f"cancel of the running job took {took:.2f} s (stop_grace 5 s)")
    assert took < 5 + 10, took            # within the grace (5 s) plus the round trips
    assert all((marks / f"long-term-{k}").exists() for k in (0, 1))    # SIGTERM, trap ran
    assert wait_until(lambda: all((marks / f"after-{k}").exists() for k in (0, 1)), 30)
    assert wait_until(lambda: _queue(cli, "c")[-1]["state"] == "succeeded", 30)
    recs = _by_id(_queue(cli, "c"))
    assert recs[long_id]["state"] == "cancelled" and recs[long_id]["exit_code"] == 143, recs
    assert recs[never_id]["state"] == "cancelled" and recs[never_id]["started"] is None
    assert not list(marks.glob("never-*"))          # the cancelled queued job never ran
    assert recs[after_id]["exit_code"] == 0


def test_guard_idle_clock_counts_queued_work_as_busy(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "idleq", "true", cluster_extra="autostop: {idle_minutes: 0.1}\n")
    r = cli.run("up", str(task), "-y", "--no-bootstrap", **FAST)
    assert r.returncode == 0, r.stderr
    assert "Budget in force on 'idleq': no budget" in r.stderr, r.stderr     # up says it
    r = cli.run("queue", "idleq", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
    roots = sorted(cli.home.glob("**/idleq/**/nodes/*/root"))
    assert len(roots) == 2, roots
    # A job waiting its turn, on every node as a launch leaves it (the record as queue.py
    # writes it; no waiter, so it stays queued).
    job_id = "20990101-000000-abcdef"
    for root in roots:
        (root / ".cloudtrain" / "queue").mkdir(mode=0o700, exist_ok=True)
        (root / ".cloudtrain" / "queue" / f"{job_id}.json").write_text(json.dumps(
            {"id": job_id, "state": "queued", "submitted_at": time.time(), "task": "t",
             "submitter": "test@here"}))
    time.sleep(12)        # the idle limit is 6 s, with no CLI contact since
    assert processes_with(f"{cli.home}/clusters/idleq/"), "the idle stop fired with work queued"
    for root in roots:
        state = json.loads((root / ".cloudtrain" / "guard" / "state.json").read_text())
        assert state["busy"] is True and state["queued"] == 1, state
    r = cli.run("cancel", "idleq", job_id)
    assert r.returncode == 0 and "removed from the queue" in r.stderr, r.stderr
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/idleq/"), 40), \
        "the idle stop did not fire once the queue was empty"
    cli.run("status", "--refresh")        # the contact that notices and removes what is left
    assert_nothing_left(cli.home)


def test_a_launch_that_would_change_the_workdir_under_a_running_job_is_refused(
        cli: CLI, tmp_path: Path) -> None:
    """Syncing a changed workdir while a job runs would replace or delete files under it: such
    a launch is refused (exit 2, the job named, nothing synced, nothing queued); the running
    job finishes on the files it started with. The same workdir queues as usual."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.txt").write_text("version 1\n")
    marks = tmp_path / "marks"
    marks.mkdir()

    def task(name: str, run: str) -> Path:
        p = _task(tmp_path, name, run)
        p.write_text(p.read_text().replace("run: |", "workdir: work\nrun: |"))
        return p

    first = task("reader", f"""
touch {marks}/started-$CLOUDTRAIN_NODE_RANK
sleep 8
cat data.txt > {marks}/read-$CLOUDTRAIN_NODE_RANK
""")
    r = cli.run("launch", str(first), "-c", "w", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    a_id = _job_id(r.stderr.split("Running job", 1)[1])
    assert wait_until(lambda: (marks / "started-1").exists(), 60)
    (work / "data.txt").write_text("version 2\n")
    changed = task("changed", "echo should not run")
    r = cli.run("launch", str(changed), "-c", "w", "-y", "-d", **FAST)
    assert r.returncode == 2, r.stderr
    assert "is busy" in r.stderr and a_id in r.stderr and "workdir" in r.stderr
    assert "Traceback" not in r.stderr
    assert [j["id"] for j in _queue(cli, "w")] == [a_id]          # nothing queued
    assert wait_until(lambda: (marks / "read-0").exists() and (marks / "read-1").exists(), 60)
    # The running job read the files it started with on every node.
    assert {(marks / f"read-{r}").read_text() for r in (0, 1)} == {"version 1\n"}
    # Once it has ended, the changed workdir launches as usual.
    assert wait_until(lambda: _by_id(_queue(cli, "w"))[a_id]["state"] == "succeeded", 30)
    r = cli.run("launch", str(changed), "-c", "w", "-y", **FAST)
    assert r.returncode == 0, r.stderr
    assert cli.run("down", "w", "-y").returncode == 0
    assert_nothing_left(cli.home)


def _waiters(roots: list[Path], job_id: str) -> list[int | None]:
    """The waiter pid of ``job_id`` on each node (None once it has none)."""
    recs = [json.loads((r / ".cloudtrain" / "queue" / f"{job_id}.json").read_text())
            for r in roots]
    return [x.get("waiter") if x.get("state") == "queued" else None for x in recs]


def _kill(pids: list[int | None]) -> None:
    for pid in pids:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_queued_job_whose_waiter_died_is_adopted_or_failed_and_the_idle_stop_fires(
        cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    idle = "autostop: {idle_minutes: 0.1}\n"     # 6 s
    first = _task(tmp_path, "first", f"touch {marks}/a-$CLOUDTRAIN_NODE_RANK; sleep 12", idle)
    adopted = _task(tmp_path, "adopted", f"touch {marks}/b-$CLOUDTRAIN_NODE_RANK", idle)
    doomed = _task(tmp_path, "doomed", f"touch {marks}/c-$CLOUDTRAIN_NODE_RANK", idle)
    r = cli.run("launch", str(first), "-c", "w", "-y", "-d", **FAST)
    assert r.returncode == 0, r.stderr
    ids = [_job_id(r.stderr.split("Running job", 1)[1])]
    for task in (adopted, doomed):
        r = cli.run("launch", str(task), "-c", "w", "-y", "-d", **FAST)
        assert r.returncode == 0 and "queued" in r.stderr, r.stderr
        ids.append(_job_id(r.stderr.split("Running job", 1)[1]))
    roots = sorted(cli.home.glob("**/w/**/nodes/*/root"))
    assert len(roots) == 2, roots
    # The waiter of the second job is killed once: the guard sees it (a poll), and the queue
    # gives the job a new waiter.
    killed = _waiters(roots, ids[1])
    assert all(killed), killed
    _kill(killed)
    assert wait_until(lambda: all(p and p not in killed for p in _waiters(roots, ids[1])), 5)
    # The third's waiters die every time (an OOM killer that keeps at it): after 3 new
    # waiters it is marked failed with the reason, within seconds.
    t0 = time.monotonic()
    while any(_waiters(roots, ids[2])) and time.monotonic() - t0 < 20:
        _kill(_waiters(roots, ids[2]))
        time.sleep(0.2)
    recs = _by_id(_queue(cli, "w"))
    assert recs[ids[2]]["state"] == "failed", recs[ids[2]]
    assert "waiter" in recs[ids[2]]["reason"] and "died" in recs[ids[2]]["reason"], recs
    assert recs[ids[1]]["state"] == "queued" and recs[ids[1]]["waiter_restarts"] == 1, recs
    table = cli.run("queue", "w")
    assert table.returncode == 0 and f"{ids[2]}: failed: its waiter" in table.stdout, table.stdout
    # The adopted job runs after the first; the failed one never runs; then the idle stop.
    assert wait_until(lambda: all((marks / f"b-{k}").exists() for k in (0, 1)), 40)
    assert not list(marks.glob("c-*"))
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/w/"), 40), \
        "the idle stop did not fire"
    assert not list(marks.glob("c-*"))
    cli.run("status", "--refresh")
    assert_nothing_left(cli.home)
