"""Budget guardrails: the estimate check and the watch as units, then end to end through the
real CLI on local nodes priced with ``resources.local.price_per_hour``."""

from __future__ import annotations

import io
import json
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from cloudtrain import budget
from cloudtrain.errors import UserError
from cloudtrain.schema import ClusterRow
from cloudtrain.state import open_state
from cloudtrain.ui import UI
from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

# --- units --------------------------------------------------------------------------------------


def test_resolve_the_budget_in_force() -> None:
    assert budget.resolve(None, 2.0, max_cost=None, hours=None, no_budget=False) is None
    b = budget.resolve(10.0, 2.0, max_cost=None, hours=None, no_budget=False)
    assert b == budget.Budget(10.0, 2.0, "max_hours")
    b = budget.resolve(10.0, 2.0, max_cost=3.0, hours=0.5, no_budget=False)
    assert b == budget.Budget(3.0, 0.5, "--hours")                      # the options win
    assert budget.resolve(10.0, None, max_cost=None, hours=None, no_budget=False).hours is None  # type: ignore[union-attr]
    assert budget.resolve(10.0, 2.0, max_cost=None, hours=None, no_budget=True) is None
    with pytest.raises(UserError):
        budget.resolve(10.0, 2.0, max_cost=1.0, hours=None, no_budget=True)


def test_estimate_before_launch() -> None:
    b = budget.Budget(10.0, 2.0, "max_hours")
    # 2 nodes x $2/h x 2 h = $8, + $1.5 already spent on the cluster = $9.5 <= $10
    assert budget.check_before_launch(b, cluster="c", price_per_node=2.0, num_nodes=2,
                                  spent=1.5) == pytest.approx(9.5)
    with pytest.raises(UserError, match=r"estimate for 2 h .* \$10\.5000.*already cost"):
        budget.check_before_launch(b, cluster="c", price_per_node=2.0, num_nodes=2, spent=2.5)
    with pytest.raises(UserError, match="more than the budget"):
        budget.check_before_launch(b, cluster="c", price_per_node=3.0, num_nodes=2, spent=0.0)
    with pytest.raises(UserError, match="max_hours") as exc:
        budget.check_before_launch(budget.Budget(10.0, None, ""), cluster="c", price_per_node=1.0,
                               num_nodes=1, spent=0.0)
    assert "--hours" in exc.value.hint
    with pytest.raises(UserError, match="unknown"):
        budget.check_before_launch(b, cluster="c", price_per_node=None, num_nodes=1, spent=0.0)
    # Free nodes fit any budget.
    assert budget.check_before_launch(b, cluster="c", price_per_node=0.0, num_nodes=4, spent=0.0) == 0.0


def test_poll_interval_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLOUDTRAIN_BUDGET_POLL", raising=False)
    assert budget.poll_interval() == budget.DEFAULT_POLL
    for raw, want in (("0.2", 0.2), ("0", budget.DEFAULT_POLL), ("x", budget.DEFAULT_POLL)):
        monkeypatch.setenv("CLOUDTRAIN_BUDGET_POLL", raw)
        assert budget.poll_interval() == want


def test_watch_warns_once_at_80_percent_and_stops_at_100(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    t0 = 1_800_000_000.0
    row = ClusterRow(name="w", provider="aws", status="UP", num_nodes=2, created_at=t0,
                     updated_at=t0, hourly_price=1.8)                  # $3.6/h = $0.001/s
    state.upsert_cluster(row)
    state.open_usage(row, when=t0)
    now = [t0 + 5]
    err = io.StringIO()
    stops: list[str] = []
    w = budget.Watch(state, "w", 0.010, UI(err=err), poll=60, clock=lambda: now[0])
    w.attach(stops.append)
    w.check()                                                        # $0.005: 50 %
    assert not w.warned and not stops and err.getvalue() == ""
    now[0] = t0 + 8.5                                                # 85 %
    w.check()
    w.check()
    assert w.warned and err.getvalue().count("85%") == 1 and not stops
    now[0] = t0 + 10.2                                               # 102 %
    w.check()
    assert w.exceeded.is_set() and stops == ["budget: $0.0102 of $0.0100"]
    now[0] = t0 + 11                                                 # still attached: again
    w.check()
    assert len(stops) == 2 and w.reason == "budget: $0.0102 of $0.0100"
    w.detach()
    w.check()
    assert len(stops) == 2
    e = w.error()
    assert e.exit_code == budget.EXIT_CODE == 3 and "$0.0102 of its $0.0100" in e.message
    # The budget is recorded on the cluster and its open interval when the watch starts.
    w2 = budget.Watch(state, "w", 0.5, UI(err=io.StringIO()), poll=60, clock=lambda: now[0])
    w2.start()
    w2.stop()
    assert state.get_cluster("w").max_cost_usd == 0.5  # type: ignore[union-attr]
    assert state.usage(cluster="w")[0].max_cost_usd == 0.5


def test_local_price_option_becomes_the_plan_price(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from cloudtrain.provider import ClusterRequest, ProviderContext
    from cloudtrain.taskmodel import Resources
    from cloudtrain_provisioners.local import LocalOptions, LocalProvider

    p = LocalProvider(ProviderContext(tmp_path))
    req = ClusterRequest(name="p", num_nodes=3, resources=Resources(provider="local"),
                         options=LocalOptions(price_per_hour=1.25), public_key="")
    assert p.plan(req).hourly_price_per_node == 1.25
    req0 = ClusterRequest(name="p", num_nodes=3, resources=Resources(provider="local"),
                          options=LocalOptions(), public_key="")
    assert p.plan(req0).hourly_price_per_node == 0.0
    with pytest.raises(ValidationError):
        LocalOptions(price_per_hour=-1)


# --- end to end ---------------------------------------------------------------------------------

PRICE = 7.2          # per node-hour: 2 nodes cost $0.004 per second
NODES = 2
RATE = PRICE * NODES / 3600.0
POLL = 0.2


def _task(d: Path, name: str, extra: str = "") -> Path:
    p = d / f"{name}.yaml"
    p.write_text(f"""
name: {name}
num_nodes: {NODES}
max_cost_usd: 0.02
resources:
  local: {{price_per_hour: {PRICE}}}
run: |
  echo "started on $CLOUDTRAIN_NODE_RANK"
  sleep 300
{extra}""")
    return p


@needs_sshd
@pytest.mark.e2e
def test_budget_reached_stops_the_job_tears_down_and_records_why(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "bud")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 0, r.stderr
    started = open_state(cli.home).usage(cluster="bud")[0].started_at
    # The budget is for the cluster, the time since 'up' included: reached ~5 s into the job.
    max_cost = RATE * (time.time() - started + 5.0)
    proc = cli.popen("launch", str(task), "-y", "--max-cost", f"{max_cost:.6f}", "--hours", "0.0001",
                     CLOUDTRAIN_BUDGET_POLL=str(POLL))
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in proc.stderr),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    # The job runs on both nodes until the budget stops it.
    assert wait_until(lambda: len(processes_with("CLOUDTRAIN_CLUSTER=bud")) >= NODES, 60)
    out = proc.stdout.read()  # type: ignore[union-attr]
    proc.wait(timeout=90)
    exited = time.time()
    reader.join(timeout=10)
    err = "".join(ln for _, ln in lines)
    assert proc.returncode == budget.EXIT_CODE == 3, err
    assert "started on 0" in out and "started on 1" in out
    assert "Traceback" not in err
    warn = next(i for i, (_, ln) in enumerate(lines) if "of its $" in ln and "at 100%" in ln)
    spent_at = next(i for i, (_, ln) in enumerate(lines) if "budget of 'bud' is spent" in ln)
    assert warn < spent_at
    assert int(re.search(r"(\d+)% of its", lines[warn][1]).group(1)) >= 80  # type: ignore[union-attr]
    assert "Budget reached: cluster 'bud'" in err and "torn down" in err
    # Nothing left: not the cluster, not a process, not a directory.
    assert cli.status() == []
    assert_nothing_left(cli.home)

    # The ledger: the cluster, why it ended, and a cost that is the budget give or take what
    # one poll and the teardown took.
    rep = cli.run("cost-report", "--json")
    assert rep.returncode == 0, rep.stderr
    (c,) = json.loads(rep.stdout)["clusters"]
    assert c["name"] == "bud" and c["status"] == "terminated"
    assert c["price_hourly_usd"] == PRICE and c["nodes"] == NODES
    m = re.fullmatch(r"budget: \$([\d.]+) of \$([\d.]+)", c["end_reason"])
    assert m is not None, c["end_reason"]
    accrued, limit = float(m.group(1)), float(m.group(2))
    assert limit == pytest.approx(max_cost, abs=1e-4)
    assert max_cost - 1e-4 <= accrued <= max_cost + RATE * (POLL + 1.0) + 1e-4
    teardown = exited - lines[spent_at][0]
    assert accrued - 1e-4 <= c["cost_usd"] <= accrued + RATE * (teardown + 0.5) + 1e-4
    assert c["max_cost_usd"] == pytest.approx(max_cost, abs=1e-6)
    # ... and the launch row.
    with sqlite3.connect(cli.home / "state.db") as db:
        status, code, why = db.execute(
            "SELECT status, exit_code, end_reason FROM launches WHERE cluster='bud'").fetchone()
    assert (status, code, why) == ("BUDGET", 3, c["end_reason"])


@needs_sshd
@pytest.mark.e2e
def test_refused_before_anything_is_created(cli: CLI, tmp_path: Path) -> None:
    # max_cost_usd 0.02 but no hours: the estimate cannot be checked.
    task = _task(tmp_path, "ref")
    r = cli.run("launch", str(task), "-y")
    assert r.returncode == 2 and "max_hours" in r.stderr and "--hours" in r.stderr, r.stderr
    # 1 h of 2 x $7.2 = $14.4 > $0.02.
    r = cli.run("launch", str(task), "-y", "--hours", "1")
    assert r.returncode == 2 and "$14.4000" in r.stderr and "more than the budget" in r.stderr
    # From the task too (max_hours), and --max-cost overrides max_cost_usd.
    hours = _task(tmp_path, "ref2", "max_hours: 0.5\n")
    r = cli.run("launch", str(hours), "-y", "--max-cost", "7")
    assert r.returncode == 2 and "$7.2000" in r.stderr and "$7.0000" in r.stderr, r.stderr
    # A detached launch takes a budget (the node guards enforce it, tests/e2e/test_guard.py)
    # and is refused the same way when the estimate is over it.
    r = cli.run("launch", str(task), "-y", "-d", "--hours", "1")
    assert r.returncode == 2 and "$14.4000" in r.stderr and "more than the budget" in r.stderr
    r = cli.run("launch", str(task), "-y", "--max-cost", "nan", "--hours", "1")
    assert r.returncode == 2
    assert cli.status() == []
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())
    assert json.loads(cli.run("cost-report", "--json").stdout)["clusters"] == []


@needs_sshd
@pytest.mark.e2e
def test_status_shows_the_hourly_price_and_the_cost_so_far(cli: CLI, tmp_path: Path) -> None:
    """`status` (table and --json): the price per node and for the cluster recorded at launch,
    and the cost so far from the ledger, growing while the cluster runs."""
    task = tmp_path / "st.yaml"
    task.write_text(f"name: st\nnum_nodes: {NODES}\nresources:\n  local: {{price_per_hour: {PRICE}}}\n"
                    "run: 'true'\n")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 0, r.stderr
    started = open_state(cli.home).usage(cluster="st")[0].started_at
    t0 = time.time()
    (s,) = cli.status()
    t1 = time.time()
    assert s["price_hourly_usd"] == PRICE and s["cluster_hourly_usd"] == pytest.approx(PRICE * NODES)
    assert s["hourly_price_per_node"] == PRICE
    # the cost at the moment status looked: between what had accrued before and after the call
    assert RATE * (t0 - started) - 1e-6 <= s["cost_so_far_usd"] <= RATE * (t1 - started) + 1e-6
    time.sleep(1.0)
    (later,) = cli.status()
    assert later["cost_so_far_usd"] >= s["cost_so_far_usd"] + RATE * 1.0 - 1e-6
    # the ledger says the same: cost-report counts the running cluster up to its own now
    rep = cli.run("cost-report", "--json")
    (c,) = json.loads(rep.stdout)["clusters"]
    assert c["cost_usd"] >= later["cost_so_far_usd"] - 1e-6 and c["price_hourly_usd"] == PRICE

    table = cli.run("status")
    assert table.returncode == 0, table.stderr
    head, row = table.stdout.splitlines()[:2]
    assert "$/H NODE" in head and "$/H CLUSTER" in head and "COST SO FAR" in head
    cells = row.split()
    assert cells[:2] == ["st", "local"] and cells[5:7] == [f"{PRICE:.2f}", f"{PRICE * NODES:.2f}"]
    assert re.fullmatch(r"\$0\.\d{4}", cells[7]), cells     # a few cents so far: $0.0xxx

    assert cli.run("down", "st", "-y").returncode == 0
    assert cli.status() == []


def test_max_hourly_cost_refuses_a_named_provider_over_it(tmp_path: Path) -> None:
    """max_hourly_cost binds also when the task names the provider (no planner pick)."""
    import os
    import subprocess
    import sys

    task = tmp_path / "t.yaml"
    task.write_text("name: capped\nnum_nodes: 2\nresources:\n  provider: local\n"
                    "  max_hourly_cost: 5\n  local:\n    price_per_hour: 3\nrun: 'true'\n")
    home = tmp_path / "home"
    env = dict(os.environ, CLOUDTRAIN_HOME=str(home), NO_COLOR="1")
    r = subprocess.run([sys.executable, "-m", "cloudtrain", "up", str(task), "-y"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "$6.00/h for 2 node(s), over resources.max_hourly_cost $5.00/h" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (home / "clusters" / "capped").exists(), "nothing may be created"
