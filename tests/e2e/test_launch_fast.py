"""A warm launch and an exec start and follow their job in one session per node (docs/queue.md,
"Round trips"): what that must keep, through the real CLI on local sshd nodes. A dropped
session is resumed at the byte it stopped at, and the job is not started a second time; a node
bootstrapped with other scripts (an older bundle, without the queue agent) is bootstrapped
again before its job goes through the queue."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_connections import _kill, _listener, _sessions, _wait_for_line  # noqa: E402

pytestmark = [needs_sshd, pytest.mark.e2e]

TICKS = 60


def test_exec_session_resumes_without_a_second_start_and_stale_nodes_rebootstrap(
        cli: CLI, tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    task = tmp_path / "fast.yaml"
    task.write_text("name: fast\nnum_nodes: 2\nresources:\n  provider: local\n"
                    "run: echo \"ran on $CLOUDTRAIN_NODE_RANK\"\n")
    r = cli.run("launch", str(task))
    assert r.returncode == 0, r.stderr
    assert "ran on 1" in r.stdout

    # exec: its one session per node is dropped mid-run on node 1; the CLI reconnects and the
    # same command resumes the log, and does not run the user's command again.
    proc = cli.popen("exec", "fast", "--", f"echo $CLOUDTRAIN_NODE_RANK >> {starts}; "
                     f"for i in $(seq 1 {TICKS}); do echo \"tick $i\"; sleep 0.05; done; exit 3")
    out = _wait_for_line(proc, "(node-1) tick 10", 60)
    sessions = _sessions(_listener(cli, "fast", 1))
    assert sessions, "no sshd session process found for node 1"
    _kill(sessions)
    assert proc.wait(timeout=120) == 3
    err = proc.stderr.read() if proc.stderr else ""
    assert "reconnected" in err, err
    assert sorted(starts.read_text().split()) == ["0", "1"]      # once per node
    shown = [ln.split(") ", 1)[1].rstrip("\n") for ln in out.complete() if "(node-1) " in ln]
    assert shown == [f"tick {i}" for i in range(1, TICKS + 1)]

    # Node 1 holds another version's scripts only: the launch bootstraps it again, and the job
    # (submitted through the queue agent of this version's bundle) runs on every node.
    boot = cli.home / "clusters" / "fast" / "local" / "nodes" / "1" / "root" / "bootstrap"
    (current,) = [d for d in boot.iterdir() if d.is_dir()]
    shutil.move(str(current), str(boot / "older"))
    (boot / "older" / "queue.py").unlink()
    r = cli.run("launch", str(task))
    assert r.returncode == 0, r.stderr
    assert "Bootstrapping" in r.stderr
    assert "ran on 0" in r.stdout and "ran on 1" in r.stdout
    assert (current / "queue.py").is_file()
