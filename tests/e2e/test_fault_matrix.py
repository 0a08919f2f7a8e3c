"""The fault matrix, signal part (docs/reliability.md, "Signals"): what the user sees, the exit
code, and that nothing of the cluster is left, when `launch --down` is stopped by a signal in
each of its phases, when the CLI is SIGKILLed, when the local state is lost, and when setup
fails on one node. Local provider here (real sshd nodes on loopback); the cloud fakes in
test_fault_matrix_clouds.py.

Each phase is reached deterministically: provision, wait for SSH, bootstrap and sync are held
open by tests/fakes/fault_cli.py (the real CLI with that phase held, test-only), setup and run by the
task's own scripts, which write a marker file and sleep.

    .venv/bin/python -m pytest -q tests/e2e/test_fault_matrix.py tests/providers/test_fault_matrix_clouds.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, needs_torch, processes_with, wait_until

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

FAULT_CLI = Path(__file__).resolve().parents[1] / "fakes" / "fault_cli.py"

TASK = """
name: fm
num_nodes: 2
workdir: .
envs:
  MARK: {mark}
setup: |
  touch "$MARK-setup-$CLOUDTRAIN_NODE_RANK"
  if [ "$PHASE" = setup ]; then sleep 600; fi
  if [ "$PHASE" = setup-fails ] && [ "$CLOUDTRAIN_NODE_RANK" = 1 ]; then echo no-deps; exit 7; fi
  true
run: |
  touch "$MARK-run-$CLOUDTRAIN_NODE_RANK"
  sleep 600
"""

PHASES = ["provision", "ssh", "bootstrap", "sync", "setup", "run"]


def _project(tmp_path: Path) -> tuple[Path, Path]:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "data.txt").write_text("x\n")
    mark = tmp_path / "mark"
    task = proj / "task.yaml"
    task.write_text(TASK.format(mark=mark))
    return task, mark


def _start(cli: CLI, phase: str, marker: Path, *args: str, **extra: str) -> subprocess.Popen[str]:
    env = cli.env(CT_FAULT_PHASE=phase if phase in ("provision", "ssh", "bootstrap", "sync")
                  else "", CT_FAULT_MARKER=str(marker), CLOUDTRAIN_SSH_TIMEOUT="15",
                  CT_FAULT_HOLD="20" if phase == "sync" else "120", **extra)
    # Its own session, like a terminal's foreground job: Ctrl-C and a closed terminal signal
    # its whole process group.
    return subprocess.Popen([sys.executable, str(FAULT_CLI), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _reached(phase: str, hook_marker: Path, mark: Path) -> bool:
    if phase in ("setup", "run"):
        return all(Path(f"{mark}-{phase}-{r}").exists() for r in (0, 1))
    return hook_marker.exists()


def _send(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    if sig == signal.SIGTERM:
        proc.send_signal(sig)            # kill PID, a service manager
    else:
        os.killpg(proc.pid, sig)         # Ctrl-C, or the terminal closing


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the CLI did not exit within {timeout} s of the signal:\n{err[-2000:]}")


def _cells() -> list[object]:
    out: list[object] = []
    for phase in PHASES:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            out.append(pytest.param(phase, sig, id=f"{phase}-{sig.name}"))
    return out


@pytest.mark.parametrize(("phase", "sig"), _cells())
def test_signal_in_each_phase_of_launch_down(cli: CLI, tmp_path: Path, phase: str,
                                             sig: signal.Signals) -> None:
    task, mark = _project(tmp_path)
    hook = tmp_path / "reached"
    proc = _start(cli, phase, hook, "launch", str(task), "--down", "--env", f"PHASE={phase}")
    try:
        assert wait_until(lambda: _reached(phase, hook, mark) or proc.poll() is not None, 120), \
            f"phase {phase} never reached"
        assert proc.poll() is None, f"the CLI ended before {phase}: {proc.communicate()[1]}"
        time.sleep(0.3)
        _send(proc, sig)
        t0 = time.monotonic()
        out, err = _finish(proc, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    took = time.monotonic() - t0
    # What the user sees: interrupted, no traceback, exit 130, and the cluster gone.
    assert proc.returncode == 130, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert "Interrupted" in err and "Traceback" not in err, err[-3000:]
    if phase in ("provision", "bootstrap"):
        assert "Rolling back" in err          # a cluster this launch created is removed
    if phase in ("setup", "run"):
        assert "stopping the job on every node" in err
    assert took < 60, f"{took:.1f} s from the signal to the exit"
    assert cli.status() == []
    assert not processes_with(str(mark)), "job processes left"
    assert_nothing_left(cli.home)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_does_not_cut_off_the_rollback_of_up(cli: CLI, tmp_path: Path,
                                                             second: signal.Signals) -> None:
    """Ctrl-C while up creates the nodes rolls the new cluster back; a second Ctrl-C (or a
    SIGTERM) while that rollback is terminating must not leave the nodes running."""
    task, _ = _project(tmp_path)
    hook, rollback = tmp_path / "reached", tmp_path / "rollback"
    proc = _start(cli, "provision", hook, "up", str(task), CT_FAULT_ROLLBACK_MARKER=str(rollback))
    try:
        assert wait_until(lambda: hook.exists() or proc.poll() is not None, 120), "never provisioned"
        assert proc.poll() is None, proc.communicate()[1]
        _send(proc, signal.SIGINT)
        assert wait_until(lambda: rollback.exists() or proc.poll() is not None, 60), \
            "the rollback never started"
        _send(proc, second)
        out, err = _finish(proc, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert "Rolling back" in err and "Traceback" not in err, err[-3000:]
    assert cli.status() == []
    assert_nothing_left(cli.home)


def test_sigkill_of_the_cli_then_down(cli: CLI, tmp_path: Path) -> None:
    task, mark = _project(tmp_path)
    proc = _start(cli, "", tmp_path / "unused", "launch", str(task), "--down")
    assert wait_until(lambda: _reached("run", tmp_path, mark), 120), proc.stderr
    os.kill(proc.pid, signal.SIGKILL)     # nothing can run in the CLI: no teardown
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # The cluster and its job are still there, and 'down' removes all of it.
    assert [c["status"] for c in cli.status()] == ["UP"]
    assert processes_with(str(mark)) or processes_with("CLOUDTRAIN_CLUSTER=fm")
    r = cli.run("down", "fm", "-y")
    assert r.returncode == 0, r.stderr
    assert "'fm' is down" in r.stderr
    assert cli.status() == []
    assert wait_until(lambda: not processes_with("CLOUDTRAIN_CLUSTER=fm"), 10)
    assert_nothing_left(cli.home)


def test_state_deleted_then_down_by_provider(cli: CLI, tmp_path: Path) -> None:
    task, mark = _project(tmp_path)
    r = cli.run("launch", str(task), "-d", "--env", "PHASE=run")
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: _reached("run", tmp_path, mark), 60)
    for f in cli.home.glob("state.db*"):
        f.unlink()
    # Without the state, 'down NAME' does not know the cluster: exit 2, and nothing is touched.
    r = cli.run("down", "fm", "-y")
    assert r.returncode == 2 and "fm" in r.stderr and "Traceback" not in r.stderr
    assert processes_with("CLOUDTRAIN_CLUSTER=fm")
    # --provider finds it by what the provider itself keeps, and removes all of it.
    r = cli.run("down", "fm", "--provider", "local", "-y")
    assert r.returncode == 0, r.stderr
    assert "'fm' is down" in r.stderr
    assert wait_until(lambda: not processes_with("CLOUDTRAIN_CLUSTER=fm"), 10)
    assert_nothing_left(cli.home)


def test_setup_failure_on_one_node(cli: CLI, tmp_path: Path) -> None:
    task, mark = _project(tmp_path)
    r = cli.run("launch", str(task), "--down", "--env", "PHASE=setup-fails")
    assert r.returncode == 7, r.stderr
    assert "setup failed on node 1 (exit code 7)" in r.stderr and "Traceback" not in r.stderr
    assert "(node-1) no-deps" in r.stdout
    assert not Path(f"{mark}-run-0").exists(), "the job ran although setup failed"
    assert cli.status() == []
    assert_nothing_left(cli.home)
