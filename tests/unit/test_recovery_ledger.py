"""The recoveries ledger (issues 13, 21): an old database gains the table (and the
``resumed_from`` column) when opened; a recovery row is written, updated and read back;
cost-report's JSON and the status line show it; a provider that cannot tell which nodes the
cloud took, or a bad CLOUDTRAIN_UNRESPONSIVE_WINDOW, is refused by --recover (exit 2)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from cloudtrain import ledger
from cloudtrain.schema import SCHEMA_VERSION
from cloudtrain.state import open_state


def test_an_old_database_gains_the_recoveries_table(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "state.db")
    db.executescript("CREATE TABLE usage (id INTEGER PRIMARY KEY AUTOINCREMENT, cluster TEXT "
                     "NOT NULL, provider TEXT NOT NULL, region TEXT, zone TEXT, instance_type "
                     "TEXT, accelerators TEXT, num_nodes INTEGER NOT NULL, use_spot INTEGER NOT "
                     "NULL DEFAULT 0, hourly_price_per_node REAL, started_at REAL NOT NULL, "
                     "ended_at REAL); PRAGMA user_version=2;")
    db.close()
    state = open_state(tmp_path)
    with sqlite3.connect(tmp_path / "state.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6
    assert state.recoveries() == []
    rid = state.add_recovery("c", "j0", "j0", 1000.0, [1, 3], "node 1: preempted",
                             "restarted from step 0")
    state.update_recovery(rid, new_job="j1", detect_s=2.0, replace_s=60.0, bootstrap_s=30.0,
                          sync_s=5.0, restart_s=3.0, lost_work_usd=0.5, replacement_usd=0.25,
                          status="RECOVERED")
    with pytest.raises(ValueError):
        state.update_recovery(rid, cluster="other")
    [r] = state.recoveries("c")
    assert (r.ranks, r.new_job, r.seconds_lost) == ([1, 3], "j1", 100.0)
    assert state.recoveries("d") == []
    [j] = ledger.recoveries_json([r])
    assert j["ranks"] == [1, 3] and j["seconds_lost"] == 100.0 and j["detected_at_unix"] == 1002.0
    assert j["lost_work_usd"] == 0.5 and j["status"] == "RECOVERED"
    line = ledger.recovery_line(r)
    assert "node(s) 1,3 (node 1: preempted); 100.0s lost" in line and "j0 -> j1" in line
    assert j["resumed_from"] == "restarted from step 0" and line.endswith("; restarted from step 0")


def test_a_version_3_database_gains_resumed_from(tmp_path: Path) -> None:
    state = open_state(tmp_path)
    state.add_recovery("c", "j0", "j0", 1000.0, [1], "node 1: preempted")
    with sqlite3.connect(tmp_path / "state.db") as db:    # as cloudtrain 3 left it
        db.executescript("ALTER TABLE recoveries DROP COLUMN resumed_from; "
                         "PRAGMA user_version=3;")
    again = open_state(tmp_path)
    [r] = again.recoveries()
    assert r.reason == "node 1: preempted" and r.resumed_from is None
    again.add_recovery("c", "j1", "j1", 2000.0, [0], "node 0: unresponsive", "restarted from step 0")
    assert [x.resumed_from for x in again.recoveries()] == [None, "restarted from step 0"]


def test_recover_is_refused_on_a_provider_without_node_health(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("not used: nothing is contacted\n")
    key.chmod(0o600)
    task = tmp_path / "t.yaml"
    task.write_text("name: mine\nnum_nodes: 1\nresources:\n  provider: ssh\n  ssh:\n    hosts:\n"
                    f"      - {{address: 127.0.0.1, port: 1, identity_file: {key}}}\n"
                    "run: 'true'\n")
    env = {"CLOUDTRAIN_HOME": str(tmp_path / "home"), "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "cloudtrain", "launch", str(task), "-y",
                        "--recover"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--recover needs a provider that reports node health" in r.stderr
    st = subprocess.run([sys.executable, "-m", "cloudtrain", "status", "--json"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert st.stdout.strip() == "[]"


def test_a_bad_unresponsive_window_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    task = tmp_path / "t.yaml"
    task.write_text("name: mine\nnum_nodes: 1\nresources: {provider: local}\nrun: 'true'\n")
    home = tmp_path / "home"
    env = {"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    for var in ("CLOUDTRAIN_UNRESPONSIVE_WINDOW", "CLOUDTRAIN_RECOVERY_HOLD"):
        for bad in ("ten", "0", "-5", "nan", "inf"):
            r = subprocess.run([sys.executable, "-m", "cloudtrain", "launch", str(task), "-y",
                                "--recover"], capture_output=True, text=True, timeout=60,
                               env={**env, var: bad})
            assert r.returncode == 2, (bad, r.stderr)
            assert f"{var}='{bad}' is not a positive number" in r.stderr
        assert "Traceback" not in r.stderr
        assert not (home / "clusters").exists() or not any((home / "clusters").iterdir())
