"""The cluster's rules compose across launches, through the real CLI on local nodes
(docs/guard.md, "Rules that compose"; docs/queue.md): a later launch keeps the budget and an
earlier --down, a launch with a budget takes the stricter, only --no-budget or `cloudtrain
budget` lift or raise it, `status` shows the rules and who set each; a --down job's end
waits for the jobs queued after it. And a lost laptop under an attached `launch --down`
costs at most a minute (the follower's heartbeat), while a short outage changes nothing."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

POLL = {"CLOUDTRAIN_GUARD_POLL": "0.3"}       # the default grace (300 s) and window (30 s)

pytestmark = [needs_sshd, pytest.mark.e2e]


def _task(d: Path, name: str, run: str) -> Path:
    p = d / f"{name}.yaml"
    body = "\n".join("  " + ln for ln in run.strip().splitlines())
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local, local: "
                 f"{{price_per_hour: 3.6}}}}\nstop_grace: 5\nrun: |\n{body}\n")
    return p


def _job_id(text: str) -> str:
    found = re.findall(r"Running job (\d{8}-\d{6}-[0-9a-f]{6})", text)
    assert found, text
    return found[0]


def _rules(cli: CLI, name: str) -> dict[str, Any]:
    entry = [e for e in cli.status() if e["name"] == name]
    assert entry, cli.status()
    return entry[0]["rules"]  # type: ignore[return-value]


def _launch(cli: CLI, task: Path, *args: str) -> tuple[str, str]:
    r = cli.run("launch", str(task), "-c", "rul", "-y", "-d", *args, **POLL)
    assert r.returncode == 0, r.stderr
    return _job_id(r.stderr), r.stderr


def test_budget_and_down_compose_across_launches_and_status_shows_who_set_them(
        cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    first = _task(tmp_path, "first", f"sleep 25; touch {marks}/a-$CLOUDTRAIN_NODE_RANK")
    later = _task(tmp_path, "later", f"sleep 2; touch {marks}/b-$CLOUDTRAIN_NODE_RANK")
    a, said = _launch(cli, first, "--down", "--max-cost", "20", "--hours", "0.1")
    assert f"Budget in force on 'rul': budget $20.0000 (set by launch {a}" in said, said
    # A plain launch keeps the budget and the earlier --down (it used to lift both).
    b, said = _launch(cli, later)
    assert f"budget $20.0000 (set by launch {a} (--max-cost))" in said, said
    rules = _rules(cli, "rul")
    assert rules["budget"]["max_cost_usd"] == 20 and rules["budget"]["set_by"]["job"] == a
    assert [d["job"] for d in rules["down_on_end"]] == [a]
    assert rules["down_on_end"][0]["set_by"]["command"] == "launch --down -d"
    # A launch refused before its job starts changes no rule and tears nothing down.
    r = cli.run("launch", str(later), "-c", "rul", "-y", "-d", "--now", "--down", "--max-cost",
                "5", "--hours", "0.1", **POLL)
    assert r.returncode == 2 and "--now" in r.stderr, r.stderr
    assert _rules(cli, "rul") == rules
    assert not list(marks.iterdir()) and processes_with(f"{cli.home}/clusters/rul/")
    # A higher budget does not raise it; a lower one is taken.
    _, said = _launch(cli, later, "--max-cost", "50", "--hours", "0.1")
    assert f"budget $20.0000 (set by launch {a}" in said, said
    c, said = _launch(cli, later, "--max-cost", "10", "--hours", "0.1")
    assert f"budget $10.0000 (set by launch {c} (--max-cost))" in said, said
    # Lifting it takes --no-budget or the budget command.
    d, said = _launch(cli, later, "--no-budget")
    assert "Budget in force on 'rul': no budget" in said, said
    assert _rules(cli, "rul")["budget"] is None
    for bad, word in ((["--max-cost", "-1"], "--max-cost"), (["--max-cost", "nan"], "--max-cost"),
                      (["--max-cost", "inf"], "--max-cost"), ([], "--max-cost"),
                      (["--off", "--max-cost", "3"], "--off")):
        r = cli.run("budget", "rul", *bad)
        assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
    assert _rules(cli, "rul")["budget"] is None                         # nothing changed
    r = cli.run("budget", "rul", "--max-cost", "30")
    assert r.returncode == 0 and "budget $30.0000 (set by budget --max-cost 30)" in r.stderr, r.stderr
    plain = cli.run("status", "rul")
    assert "rul: rules: budget $30.0000 (set by budget --max-cost 30)" in plain.stdout, plain.stdout
    assert f"down once job {a} has ended and nothing runs or waits (set by launch {a} --down -d)" \
        in plain.stdout, plain.stdout
    # The first job's --down: the jobs queued after it run first, then the cluster goes.
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/rul/"), 120), \
        "the cluster did not go down after its queue drained"
    assert sorted(p.name for p in marks.iterdir()) == ["a-0", "a-1"] + [
        f"b-{k}" for k in (0, 1)], sorted(p.name for p in marks.iterdir())
    r = cli.run("status", "--refresh", "--json")
    assert r.returncode == 0, r.stderr
    gone = [e for e in json.loads(r.stdout) if e["name"] == "rul"]
    assert gone and gone[0]["status"] == "GONE" and gone[0]["reason"] == "job-end", gone
    assert_nothing_left(cli.home)


def test_a_lost_laptop_under_an_attached_down_costs_at_most_a_minute(
        cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    task = _task(tmp_path, "lost", f"sleep 4; touch {marks}/done-$CLOUDTRAIN_NODE_RANK")
    # A short outage (the CLI frozen for 20 s across the job's end, less than the 30 s
    # window) changes nothing: the CLI comes back, pulls, tears down itself.
    proc = cli.popen("launch", str(task), "-c", "brief", "-y", "--down", **POLL)
    assert wait_until(lambda: len(processes_with("CLOUDTRAIN_CLUSTER=brief")) >= 2, 90)
    proc.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: len(list(marks.iterdir())) == 2, 30), "the job did not complete"
    time.sleep(14)
    assert processes_with(f"{cli.home}/clusters/brief/"), "the nodes acted during the outage"
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "succeeded on every node" in err, out + err
    assert_nothing_left(cli.home)
    for p in marks.iterdir():
        p.unlink()

    # The CLI SIGKILLed (the laptop gone): the nodes act within a minute of the job's end,
    # not after the 300 s grace.
    proc = cli.popen("launch", str(task), "-c", "lost", "-y", "--down", **POLL)
    assert wait_until(lambda: len(processes_with("CLOUDTRAIN_CLUSTER=lost")) >= 2, 90)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert wait_until(lambda: len(list(marks.iterdir())) == 2, 30), "the job did not complete"
    ended = max(p.stat().st_mtime for p in marks.iterdir())
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/lost/"), 75), \
        "the nodes did not stop themselves"
    took = time.time() - ended
    print(f"the nodes stopped {took:.1f} s after the job's end (CLI SIGKILLed)")
    assert took <= 60, took
    r = cli.run("status", "--refresh", "--json")
    gone = [e for e in json.loads(r.stdout) if e["name"] == "lost"]
    assert gone and gone[0]["reason"] == "job-end", gone
    assert_nothing_left(cli.home)


def test_an_attached_down_lets_a_job_queued_after_it_run_first(cli: CLI, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    first = _task(tmp_path, "first", f"sleep 8; touch {marks}/a-$CLOUDTRAIN_NODE_RANK")
    later = _task(tmp_path, "later", f"sleep 3; touch {marks}/b-$CLOUDTRAIN_NODE_RANK")
    proc = cli.popen("launch", str(first), "-c", "rul", "-y", "--down", **POLL)
    assert wait_until(lambda: len(processes_with("CLOUDTRAIN_CLUSTER=rul")) >= 2, 90)
    b, said = _launch(cli, later)
    assert "queued" in said, said
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    # When the CLI looks, job b is still queued or (its turn came at once) already running.
    assert re.search(rf"'rul' stays up: job {b} \((queued|running)\) came after this one and "
                     "goes first", err), err
    # The queued job runs after the attached one; then the nodes take the cluster down.
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/rul/"), 90), \
        "the cluster did not go down once its queue drained"
    assert sorted(p.name for p in marks.iterdir()) == ["a-0", "a-1", "b-0", "b-1"]
    r = cli.run("status", "--refresh", "--json")
    gone = [e for e in json.loads(r.stdout) if e["name"] == "rul"]
    assert gone and gone[0]["reason"] == "job-end", gone
    assert_nothing_left(cli.home)
