"""The persistent SSH connections (OpenSSH masters) between commands: reused while the node
is the same, never once it is replaced (new host key), refused when the node presents another
key than the pinned one, and gone after ``down``. Through the real CLI on local sshd nodes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from cloudtrain_provisioners.local import sshd
from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]

TASK = """
name: mux
num_nodes: 2
run: "true"
"""


def _masters(home: Path) -> dict[int, int]:
    """pid -> rank of the OpenSSH masters this home's commands left (by command line)."""
    out = {}
    for pid in processes_with(str(home)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0] == b"ssh" and b"-M" in argv:
            path = next(a for a in argv if a.startswith(b"ControlPath="))
            out[pid] = int(path.rsplit(b"/", 1)[1].split(b"-")[1])
    return out


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _node_dir(cli: CLI, rank: int) -> Path:
    return cli.home / "clusters" / "mux" / "local" / "nodes" / str(rank)


def _listener(cli: CLI, rank: int) -> int:
    return int((_node_dir(cli, rank) / "sshd.pid").read_text().split()[0])


def _client_port(cli: CLI, rank: int) -> int:
    """exec on one node: the client-side port of the SSH connection the command came over
    (one per master connection)."""
    r = cli.run("exec", "mux", "--node", str(rank), "--", "echo conn=$SSH_CONNECTION")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "conn=" in ln)
    return int(line.split("conn=")[1].split()[1])


def _pin(cli: CLI, rank: int, key_line: str) -> None:
    """What cloudtrain does when a node is replaced: the new node's key is pinned for its
    address (here the same address)."""
    cfg = (_node_dir(cli, rank) / "sshd_config").read_text().split()
    addr, port = cfg[cfg.index("ListenAddress") + 1].rsplit(":", 1)
    kh = cli.home / "clusters" / "mux" / "ssh" / "known_hosts"
    name = f"[{addr}]:{port}"
    lines = [ln for ln in kh.read_text().splitlines() if not ln.startswith(name + " ")]
    kh.write_text("\n".join(lines + [f"{name} {key_line}"]) + "\n")


def test_a_replaced_node_or_down_never_reuses_a_multiplexed_connection(
        cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "mux.yaml"
    task.write_text(TASK)
    assert cli.run("up", str(task), "-y").returncode == 0
    old_listener = _listener(cli, 1)
    # Commands reuse one master per node: two commands, one connection (same client port).
    port = _client_port(cli, 1)
    first = _masters(cli.home)
    assert sorted(first.values()) == [0, 1], first
    assert _client_port(cli, 1) == port
    assert _masters(cli.home) == first
    old_sessions = _children(old_listener)
    assert old_sessions

    # Node 1 is replaced at the same address by a machine with a new host key. The old
    # machine's established session lives on (its listener is gone), so the old master still
    # answers: once the new key is pinned, it must not be used for the new node.
    os.kill(old_listener, signal.SIGTERM)
    assert wait_until(lambda: not Path(f"/proc/{old_listener}").exists(), 10)
    d = _node_dir(cli, 1)
    for f in ("ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"):
        (d / f).unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    str(d / "ssh_host_ed25519_key")], check=True)
    subprocess.run(["/usr/sbin/sshd", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")],
                   check=True)
    new_key = " ".join((d / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    # sshd's parent returns before the daemon has written its pid file (read it once it has).
    assert wait_until(lambda: sshd.pid(d) is not None, 10)
    new_listener = _listener(cli, 1)
    assert new_listener != old_listener

    # cloudtrain pins the new machine's key: the next command connects anew, to it.
    marker = tmp_path / "ran"
    _pin(cli, 1, new_key)
    assert _client_port(cli, 1) != port
    masters = _masters(cli.home)
    old = [p for p, rank in first.items() if rank == 1]
    assert not set(old) & set(masters), "the replaced node's old master is still running"
    assert sorted(masters.values()) == [0, 1], masters
    # ... and its connection to the old machine is closed.
    assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in old_sessions), 10)
    assert _children(new_listener), "the new master is not connected to the new machine"

    # A key that is pinned but not what the node presents: refused, nothing runs.
    _pin(cli, 1, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA1gpfaA5m1C0cz2KNqWk9Pb4q45VAgbmOgP5VRB7zV1")
    r = cli.run("exec", "mux", "--node", "1", "--", f"touch {marker}")
    assert r.returncode != 0 and "presented a host key different" in r.stderr, r.stderr
    assert not marker.exists()
    _pin(cli, 1, new_key)

    # down ends every master; the same name comes up again on new connections.
    assert cli.run("down", "mux", "-y").returncode == 0
    assert_nothing_left(cli.home)
    assert cli.run("up", str(task), "-y").returncode == 0
    assert _client_port(cli, 0) > 0 and sorted(_masters(cli.home).values()) == [0, 1]
    assert cli.run("down", "mux", "-y").returncode == 0
    assert_nothing_left(cli.home)


def test_with_persisting_off_every_command_connects_on_its_own(cli: CLI, tmp_path: Path) -> None:
    """CLOUDTRAIN_SSH_PERSIST=0 (or no OpenSSH client): no master is left between commands;
    up, launch and exec work the same (paramiko, one connection per command)."""
    task = tmp_path / "mux.yaml"
    task.write_text(TASK.replace('run: "true"', 'run: echo "ran on $CLOUDTRAIN_NODE_RANK"'))
    r = cli.run("launch", str(task), "-y", CLOUDTRAIN_SSH_PERSIST="0")
    assert r.returncode == 0, r.stderr
    assert "ran on 0" in r.stdout and "ran on 1" in r.stdout
    r = cli.run("exec", "mux", "--", "echo conn=$SSH_CONNECTION", CLOUDTRAIN_SSH_PERSIST="0")
    assert r.returncode == 0 and r.stdout.count("conn=") == 2, r.stderr
    assert _masters(cli.home) == {}
    bad = cli.run("exec", "mux", "--", "true", CLOUDTRAIN_SSH_PERSIST="soon")
    assert bad.returncode == 2 and "CLOUDTRAIN_SSH_PERSIST" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert cli.run("down", "mux", "-y", CLOUDTRAIN_SSH_PERSIST="0").returncode == 0
    assert_nothing_left(cli.home)
