"""Connections that drop, nodes that die, Ctrl-C while waiting on nodes, memory: through the
real CLI on the local provider (real sshd nodes on loopback)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, needs_torch, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]


def _task(d: Path, name: str, body: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(body)
    return p


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _descendants(root: int) -> list[int]:
    parents = {int(p.name): _ppid(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    out, todo = [], [root]
    while todo:
        cur = todo.pop()
        kids = [p for p, pp in parents.items() if pp == cur]
        out += kids
        todo += kids
    return out


def _listener(cli: CLI, cluster: str, rank: int) -> int:
    return int((cli.home / "clusters" / cluster / "local" / "nodes" / str(rank) / "sshd.pid")
               .read_text().split()[0])


def _sessions(listener: int) -> list[int]:
    """The per-connection sshd processes under a node's listening sshd."""
    return [p for p in _descendants(listener) if _comm(p).startswith("sshd")]


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Lines(list[str]):
    """The CLI's stdout lines read so far; ``complete()`` waits until the pipe's end (after
    the CLI exited, its last lines may still be on their way to the reader thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.eof = threading.Event()

    def complete(self, timeout: float = 30) -> _Lines:
        assert self.eof.wait(timeout), "the CLI's stdout did not reach its end"
        return self


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> _Lines:
    """Read the CLI's stdout until a line holds ``needle``; the rest is drained in the
    background (kept in the returned list) so the CLI never blocks on a full pipe."""
    seen = _Lines()
    found = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                seen.append(line)
                if needle in line:
                    found.set()
        finally:
            seen.eof.set()

    threading.Thread(target=pump, daemon=True).start()
    assert found.wait(timeout), f"no line with {needle!r} in {timeout} s: {seen[-5:]}"
    return seen


TICKS = 120
TICKER = f"""
name: {{name}}
num_nodes: 2
run: |
  for i in $(seq 1 {TICKS}); do echo "tick $i of $CLOUDTRAIN_NODE_RANK"; sleep 0.1; done
  echo "done on $CLOUDTRAIN_NODE_RANK"
"""


def test_dropped_session_reconnects_and_the_log_is_complete(cli: CLI, tmp_path: Path) -> None:
    """Finding 4: killing the sshd process that serves node 1's session mid-run is a dropped
    connection, not the job's exit: the CLI reconnects, resumes the log at the byte it had,
    and the job completes with exit 0."""
    task = _task(tmp_path, "ticks", TICKER.format(name="ticks"))
    proc = cli.popen("launch", str(task))
    out = _wait_for_line(proc, "tick 20 of 1", 120)
    sessions = _sessions(_listener(cli, "ticks", 1))
    assert sessions, "no sshd session process found for node 1"
    _kill(sessions)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    err = proc.stderr.read() if proc.stderr else ""
    assert "reconnected" in err, err
    assert "Traceback" not in err
    out.complete()
    assert any("done on 1" in ln for ln in out)
    # Every line exactly once, in order, on the terminal and in the local log file.
    (job,) = (cli.home / "logs" / "ticks").iterdir()
    logged = (job / "node-1.log").read_text().splitlines()
    want = [f"tick {i} of 1" for i in range(1, TICKS + 1)] + ["done on 1"]
    assert logged == want
    shown = [ln.split(") ", 1)[1].rstrip("\n") for ln in out if "(node-1) " in ln]
    assert shown == want


def test_logs_follow_reconnects_and_misses_nothing(cli: CLI, tmp_path: Path) -> None:
    """Finding 5 for `logs --follow`: a dropped session is resumed at the byte it stopped at."""
    task = _task(tmp_path, "ticks", TICKER.format(name="follow"))
    d = cli.run("launch", str(task), "-d")
    assert d.returncode == 0, d.stderr
    proc = cli.popen("logs", "follow", "--follow")
    out = _wait_for_line(proc, "tick 20 of 1", 120)
    _kill(_sessions(_listener(cli, "follow", 1)))
    rc = proc.wait(timeout=120)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, err
    assert "reconnected" in err and "Traceback" not in err
    out.complete()
    want = [f"tick {i} of 1" for i in range(1, TICKS + 1)] + ["done on 1"]
    assert [ln.split(") ", 1)[1].rstrip("\n") for ln in out if "(node-1) " in ln] == want


@needs_torch
def test_dropped_session_ddp_job_survives(cli: CLI, demo_dir: Path) -> None:
    """Finding 4 with the 2-node x 2-process DDP fixture: the distributed job survives node
    1's session being dropped and trains to the end."""
    import json

    text = (demo_dir / "task.yaml").read_text().replace("name: demo", "name: ddpdrop")
    text += "envs:\n  SLEEP_SECONDS: 6\n"
    task = _task(demo_dir, "drop", text)
    proc = cli.popen("launch", str(task), "--down")
    out = _wait_for_line(proc, "all-reduce ok", 240)
    _kill(_sessions(_listener(cli, "ddpdrop", 1)))
    rc = proc.wait(timeout=240)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, err
    assert "reconnected" in err
    res = json.loads((demo_dir / "cloudtrain-outputs" / "outputs" / "result.json").read_text())
    assert res["world_size"] == 4 and res["replicas_in_sync"] is True
    # None lost or repeated. Counted in the whole output, not per line: two ranks of a node
    # write to one log unbuffered (PYTHONUNBUFFERED), so their lines can interleave mid-line.
    assert "".join(out.complete()).count("all-reduce ok") == 4
    assert_nothing_left(cli.home)


@pytest.mark.parametrize("down", [True, False])
def test_node_lost_for_good_is_named_in_time(cli: CLI, tmp_path: Path, down: bool) -> None:
    """Findings 5 and 18: node 1's sshd killed for good (listener and sessions). It is named,
    with its address, within the node timeout; the job is stopped on node 0; with --down the
    cluster is torn down and nothing is left."""
    task = _task(tmp_path, "lost", """
name: lost
num_nodes: 2
run: |
  echo "up on $CLOUDTRAIN_NODE_RANK"
  sleep 600
""")
    proc = cli.popen("launch", str(task), *(["--down"] if down else []), CLOUDTRAIN_NODE_TIMEOUT="5")
    seen = _wait_for_line(proc, "up on 1", 120)
    assert wait_until(lambda: any("up on 0" in ln for ln in seen), 30), seen
    listener = _listener(cli, "lost", 1)
    t0 = time.monotonic()
    _kill([listener] + _sessions(listener))
    rc = proc.wait(timeout=120)
    took = time.monotonic() - t0
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 1, err
    assert "error: lost the connection to node 1 (root@127." in err, err
    assert "exited with code -1" not in err and "Traceback" not in err
    assert "CLOUDTRAIN_NODE_TIMEOUT" in err
    # 5 s of silence, then stopping node 0 (grace) and, with --down, the teardown.
    assert took < 5 + 40, took
    if down:
        assert cli.status() == []
        assert_nothing_left(cli.home)
    else:
        # The job no longer runs on node 0 (the node that still answers).
        assert wait_until(lambda: not processes_with("CLOUDTRAIN_NODE_RANK=0"), 10)
        assert [c["name"] for c in cli.status()] == ["lost"]


def test_silent_node_is_named_not_waited_for(cli: CLI, tmp_path: Path) -> None:
    """Finding 5: node 1 stops answering without closing anything (its sshd frozen with
    SIGSTOP: no RST, no FIN). The CLI does not hang: the node is named within the timeout."""
    task = _task(tmp_path, "quiet", """
name: quiet
num_nodes: 2
run: |
  echo "up on $CLOUDTRAIN_NODE_RANK"
  sleep 600
""")
    proc = cli.popen("launch", str(task), CLOUDTRAIN_NODE_TIMEOUT="5")
    seen = _wait_for_line(proc, "up on 1", 120)
    assert wait_until(lambda: any("up on 0" in ln for ln in seen), 30), seen
    listener = _listener(cli, "quiet", 1)
    frozen = [listener] + _sessions(listener)
    t0 = time.monotonic()
    for p in frozen:
        os.kill(p, signal.SIGSTOP)
    try:
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        for p in frozen:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 1, err
    assert "error: lost the connection to node 1 (root@127." in err, err
    assert "Traceback" not in err
    assert took < 5 + 40, took
    assert wait_until(lambda: not processes_with("CLOUDTRAIN_NODE_RANK=0"), 10)


def test_sighup_leaves_no_follower_on_the_nodes(cli: CLI, tmp_path: Path) -> None:
    """Finding 19: the terminal closes (SIGHUP to the CLI): the log followers (tail under the
    SSH sessions) end with their sessions."""
    task = _task(tmp_path, "hup", """
name: hup
num_nodes: 2
run: |
  echo "up on $CLOUDTRAIN_NODE_RANK"
  sleep 600
""")
    proc = cli.popen("launch", str(task))
    _wait_for_line(proc, "up on 1", 120)
    nodes = str(cli.home / "clusters" / "hup")

    def followers() -> list[int]:
        # ctjob.sh itself (its header is in its command line when it travels inline), its
        # follower (python: its code, with its protocol words, is in its command line), and
        # the queue agent that follows a launch's job in-process
        return [p for p in processes_with(nodes)
                if b"Start one job on this node" in _cmdline(p) or b"::ctjob" in _cmdline(p)
                or b"queue.py\0run\0" in _cmdline(p)]

    assert wait_until(lambda: len(followers()) >= 2, 30), followers()
    proc.send_signal(signal.SIGHUP)
    proc.wait(timeout=120)
    assert wait_until(lambda: not followers(), 10), f"followers left: {followers()}"


def _key(tmp_path: Path) -> Path:
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


def test_ctrl_c_while_waiting_for_ssh_exits_130_at_once(cli: CLI, tmp_path: Path) -> None:
    """Finding 17: one host refuses connections, the other accepts and never answers. Ctrl-C
    while the CLI waits for them ends it with 130 at once (not 'unreachable', not after the
    SSH timeout)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))   # bound, never listening: connection refused
    key = _key(tmp_path)
    task = _task(tmp_path, "wait", f"""
name: waits
num_nodes: 2
resources:
  provider: ssh
  ssh:
    hosts:
      - {{address: 127.0.0.1, port: {closed.getsockname()[1]}, identity_file: {key}}}
      - {{address: 127.0.0.1, port: {silent.getsockname()[1]}, identity_file: {key}}}
run: 'true'
""")
    try:
        proc = cli.popen("launch", str(task), "-y")
        silent.settimeout(60)
        conn, _ = silent.accept()     # the CLI is now waiting for SSH
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        conn.close()
    finally:
        silent.close()
        closed.close()
    assert proc.returncode == 130, err
    assert took < 3, took
    assert "unreachable" not in err and "Traceback" not in err
    assert "Interrupted" in err


def test_ctrl_c_during_sync_exits_130_at_once(cli: CLI, tmp_path: Path) -> None:
    """Finding 17: Ctrl-C while rsync runs ends the CLI with 130 at once, not 'Sync failed ...
    rsync exit 20', and leaves no rsync running."""
    proj = tmp_path / "p"
    proj.mkdir()
    with open(proj / "big.bin", "wb") as f:   # sparse here; rsync sends every byte
        f.truncate(4 << 30)
    task = _task(proj, "sync", "name: syncs\nnum_nodes: 1\nworkdir: .\nrun: 'true'\n")
    proc = cli.popen("launch", str(task))

    def rsyncs() -> list[int]:
        return [p for p in _descendants(proc.pid) if _comm(p) == "rsync"]

    assert wait_until(lambda: bool(rsyncs()), 120), proc.stderr
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, err
    assert took < 3, took
    assert "Sync failed" not in err and "Traceback" not in err
    assert wait_until(lambda: not [p for p in processes_with(str(proj)) if _comm(p) == "rsync"], 10)


@pytest.mark.parametrize("var", ["CLOUDTRAIN_NODE_TIMEOUT", "CLOUDTRAIN_GUARD_POLL"])
@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_bad_node_timeout_is_refused_before_anything_exists(cli: CLI, tmp_path: Path,
                                                            value: str, var: str) -> None:
    task = _task(tmp_path, "t", "name: badto\nnum_nodes: 1\nrun: 'true'\n")
    r = cli.run("launch", str(task), **{var: value})
    assert r.returncode == 2, r.stderr
    assert var in r.stderr and "Traceback" not in r.stderr
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())


BIG_LINES = 150_000   # x 1000 bytes: 150 MB of job output


def _peak_rss_mb(cli: CLI, task: Path) -> float:
    """The CLI process's own peak RSS (VmHWM, read until it exits; its children not counted)."""
    proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "launch", str(task)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=cli.env())
    assert proc.stderr is not None
    err_lines: list[str] = []
    t = threading.Thread(target=lambda: err_lines.extend(proc.stderr or []), daemon=True)
    t.start()
    peak = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    t.join(5)
    assert proc.returncode == 0, "".join(err_lines)
    return peak / 1024   # kB -> MB


def test_job_output_is_not_held_in_memory(cli: CLI, tmp_path: Path) -> None:
    """Finding 6: 150 MB of job output goes to the log file; the CLI's peak RSS grows by far
    less than that (it held all of it before: 62 -> 354 MB)."""
    small = _task(tmp_path, "small", "name: mem\nnum_nodes: 1\nrun: 'echo hello'\n")
    big = _task(tmp_path, "big", f"""
name: mem
num_nodes: 1
run: |
  yes "$(printf '%0999d' 0)" | head -n {BIG_LINES}
""")
    base = _peak_rss_mb(cli, small)
    before = set((cli.home / "logs" / "mem").iterdir())
    peak = _peak_rss_mb(cli, big)
    # The big job's folder: the new one (two launches can now share a second, and job ids
    # sort by their random part within it).
    (logs,) = set((cli.home / "logs" / "mem").iterdir()) - before
    assert (logs / "node-0.log").stat().st_size == BIG_LINES * 1000
    print(f"peak RSS: tiny job {base:.0f} MB, 150 MB job {peak:.0f} MB")
    assert peak - base < 60, f"peak RSS {peak:.0f} MB against {base:.0f} MB for a tiny job"
