"""Issue 14: the SSH config integration, with the real OpenSSH client against local nodes.

``up`` writes ``$CLOUDTRAIN_HOME/ssh/<cluster>.conf`` (a Host entry per node: the cluster's
key, its pinned known_hosts, StrictHostKeyChecking yes); ``~/.ssh/config`` gets one Include
line with the user's consent; ``down`` removes the cluster's file.

HOME points at a temporary folder. OpenSSH takes ``~`` from the password database, not from
$HOME, so the client is pointed at that HOME's config with ``-F HOME/.ssh/config``: the file
a user's ``ssh`` reads by itself, Include line and all; nothing else is given on its command
line.
"""

from __future__ import annotations

import os
import pty
import select
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd

pytestmark = [needs_sshd, pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")]

USER_CONFIG = (b"# my own settings\nHost myown\n    HostName example.invalid\n    User me\n\n"
               b"Host *.corp\n    ForwardAgent no\n    Port 2202")   # no trailing newline


def _task(d: Path, name: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local}}\nrun: 'true'\n")
    return p


def _ssh(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(home / ".ssh" / "config"), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HOME": str(home)}, stdin=subprocess.DEVNULL)


def _resolved(home: Path, host: str) -> dict[str, str]:
    """What OpenSSH makes of ``host`` with this HOME's config (ssh -G: no connection)."""
    r = _ssh(home, "-G", host)
    assert r.returncode == 0, r.stderr
    out: dict[str, str] = {}
    for line in r.stdout.splitlines():
        k, _, v = line.partition(" ")
        out.setdefault(k, v)
    return out


def _includes(cfg: Path) -> int:
    return sum(1 for ln in cfg.read_text().splitlines() if ln.startswith("Include "))


def test_ssh_scp_rsync_to_a_cluster_and_down_removes_its_entries(cli: CLI, tmp_path: Path) -> None:
    home = tmp_path / "user"
    home.mkdir()
    r = cli.run("up", str(_task(tmp_path, "sshcl")), "-y", "--no-bootstrap", "--ssh-config",
                HOME=str(home))
    assert r.returncode == 0, r.stderr
    cfg = home / ".ssh" / "config"
    assert stat.S_IMODE((home / ".ssh").stat().st_mode) == 0o700
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert cfg.read_text().splitlines()[1] == f"Include {cli.home / 'ssh'}/*.conf"
    conf = cli.home / "ssh" / "sshcl.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    text = conf.read_text()
    assert "Host sshcl-0 sshcl\n" in text and "Host sshcl-1\n" in text
    assert text.count("StrictHostKeyChecking yes") == 2
    after_up = cfg.read_bytes()

    # plain ssh: the head by the cluster's name, every node by <cluster>-<rank>
    r = _ssh(home, "sshcl", "hostname")
    assert r.returncode == 0 and r.stdout.strip() == socket.gethostname(), r.stderr
    r = _ssh(home, "sshcl-1", "echo", "rank-one")
    assert r.returncode == 0 and r.stdout.strip() == "rank-one", r.stderr

    # scp and rsync -e ssh to mycluster: (the local nodes share this file system)
    src = tmp_path / "payload.txt"
    src.write_text("through scp\n")
    # -O: the scp protocol (the local nodes' sshd runs every session through a ForceCommand,
    # which its internal SFTP server does not pass; a real node's sshd serves both)
    r = subprocess.run(["scp", "-O", "-F", str(cfg), str(src), f"sshcl:{tmp_path}/copied.txt"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "copied.txt").read_text() == "through scp\n"
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "sub" / "a.txt").write_text("through rsync\n")
    r = subprocess.run(["rsync", "-a", "-e", f"ssh -F {cfg}", f"{tmp_path}/tree/",
                        f"sshcl-1:{tmp_path}/synced/"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "synced" / "sub" / "a.txt").read_text() == "through rsync\n"

    # a node presenting another host key than the pinned one is refused
    kh = cli.home / "clusters" / "sshcl" / "ssh" / "known_hosts"
    pinned = kh.read_text()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    other = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode().split()[1]
    kh.write_text("".join(f"{ln.split()[0]} ssh-ed25519 {other}\n" for ln in pinned.splitlines()))
    r = _ssh(home, "sshcl", "true")
    assert r.returncode == 255 and "Host key verification failed" in r.stderr, r.stderr
    kh.write_text(pinned)

    # a second install changes nothing
    r = cli.run("ssh-config", "install", HOME=str(home))
    assert r.returncode == 0 and "nothing was changed" in r.stderr, r.stderr
    assert cfg.read_bytes() == after_up and _includes(cfg) == 1

    # down: the cluster's file is gone, the user's config untouched
    r = cli.run("down", "sshcl", "-y", HOME=str(home))
    assert r.returncode == 0, r.stderr
    assert not conf.exists()
    assert cfg.read_bytes() == after_up
    r = _ssh(home, "sshcl", "true", timeout=20)
    assert r.returncode == 255, r.stdout
    assert_nothing_left(cli.home)

    # uninstall: ~/.ssh/config did not exist before the install, so it is gone again
    r = cli.run("ssh-config", "uninstall", HOME=str(home))
    assert r.returncode == 0, r.stderr
    assert not cfg.exists()


def test_include_added_once_and_uninstall_is_byte_identical(cli: CLI, tmp_path: Path) -> None:
    home = tmp_path / "user"
    (home / ".ssh").mkdir(parents=True)
    cfg = home / ".ssh" / "config"
    cfg.write_bytes(USER_CONFIG)
    cfg.chmod(0o644)
    # a cluster file as 'up' writes it (the Include must reach it; no sshd needed for ssh -G)
    (cli.home / "ssh").mkdir(mode=0o700)
    conf = cli.home / "ssh" / "fake.conf"
    conf.write_text("Host fake fake-0\n    HostName 127.0.0.9\n    Port 2299\n")
    conf.chmod(0o600)

    for _ in range(2):
        r = cli.run("ssh-config", "install", HOME=str(home))
        assert r.returncode == 0, r.stderr
    data = cfg.read_bytes()
    assert _includes(cfg) == 1
    assert data.splitlines()[1].startswith(b"Include ") and data.endswith(USER_CONFIG)
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o644      # the user's mode is kept
    # OpenSSH reads the cluster's entry, and the user's own blocks still apply as before
    assert _resolved(home, "fake")["port"] == "2299"
    assert _resolved(home, "fake")["hostname"] == "127.0.0.9"
    assert _resolved(home, "myown")["hostname"] == "example.invalid"
    assert _resolved(home, "x.corp")["port"] == "2202"
    assert _resolved(home, "elsewhere")["port"] == "22"

    # a cluster torn down: no entry left, the user's config unchanged
    conf.unlink()
    assert _resolved(home, "fake")["hostname"] == "fake"
    assert cfg.read_bytes() == data

    r = cli.run("ssh-config", "uninstall", HOME=str(home))
    assert r.returncode == 0, r.stderr
    assert cfg.read_bytes() == USER_CONFIG
    r = cli.run("ssh-config", "uninstall", HOME=str(home))
    assert r.returncode == 0 and cfg.read_bytes() == USER_CONFIG


def test_symlinked_config_edited_at_its_target_or_left_alone(cli: CLI, tmp_path: Path) -> None:
    home = tmp_path / "user"
    (home / ".ssh").mkdir(parents=True)
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    target = dotfiles / "ssh_config"
    target.write_bytes(USER_CONFIG)
    cfg = home / ".ssh" / "config"
    cfg.symlink_to(target)
    r = cli.run("ssh-config", "install", HOME=str(home))
    assert r.returncode == 0, r.stderr
    assert cfg.is_symlink() and _includes(target) == 1
    r = cli.run("ssh-config", "uninstall", HOME=str(home))
    assert r.returncode == 0 and cfg.is_symlink() and target.read_bytes() == USER_CONFIG

    # a link to something that is not a regular file: nothing is written, the line is shown
    cfg.unlink()
    cfg.symlink_to(tmp_path / "missing")
    r = cli.run("ssh-config", "install", HOME=str(home))
    assert r.returncode == 2, r.stderr
    assert "by hand" in r.stderr and f"Include {cli.home / 'ssh'}/*.conf" in r.stderr
    assert cfg.is_symlink() and not (tmp_path / "missing").exists()


def test_home_with_a_space_is_quoted_for_openssh(tmp_path: Path) -> None:
    spaced = tmp_path / "Application Support" / "ct"
    cli = CLI(spaced)
    home = tmp_path / "user"
    home.mkdir()
    r = cli.run("ssh-config", "install", HOME=str(home))
    assert r.returncode == 0, r.stderr
    (spaced / "ssh" / "sp.conf").write_text("Host sp\n    Port 2233\n")
    (spaced / "ssh" / "sp.conf").chmod(0o600)
    assert _resolved(home, "sp")["port"] == "2233"


def test_bad_input(cli: CLI, tmp_path: Path) -> None:
    r = cli.run("ssh-config", "reinstall")
    assert r.returncode == 2 and "reinstall" in r.stderr
    r = cli.run("up", str(_task(tmp_path, "_bad_name")), "-y", "--ssh-config",
                HOME=str(tmp_path / "user"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "user" / ".ssh").exists()
    assert not list((cli.home / "ssh").glob("*.conf"))


def _up_on_a_terminal(cli: CLI, task: Path, home: Path, answer: bytes | None) -> str:
    """``up`` with a terminal on stdin and stderr; ``answer`` the question about the Include
    line when it comes (None: it must not come). Returns what the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "up", str(task), "-y",
                             "--no-bootstrap"], stdin=slave, stdout=slave, stderr=slave,
                            env=cli.env(HOME=str(home)), start_new_session=True)
    os.close(slave)
    seen, answered, deadline = b"", False, time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                seen += chunk
            if b"(asked once)?" in seen and not answered:
                assert answer is not None, seen.decode(errors="replace")
                os.write(master, answer + b"\n")
                answered = True
            if proc.poll() is not None and not ready:
                break
        assert proc.wait(timeout=30) == 0, seen.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert answered == (answer is not None), seen.decode(errors="replace")
    return seen.decode(errors="replace")


def test_interactive_up_asks_once_and_remembers(cli: CLI, tmp_path: Path) -> None:
    home = tmp_path / "user"
    home.mkdir()
    task = _task(tmp_path, "asked")
    out = _up_on_a_terminal(cli, task, home, b"n")
    assert "Not added" in out and not (home / ".ssh").exists()
    assert (cli.home / "ssh" / "asked.conf").exists()      # the cluster's own file is there
    _up_on_a_terminal(cli, task, home, None)                # not asked again
    assert not (home / ".ssh").exists()
    r = cli.run("ssh-config", "install", HOME=str(home))   # the explicit way still works
    assert r.returncode == 0, r.stderr
    assert _ssh(home, "asked", "true").returncode == 0
    r = cli.run("down", "asked", "-y")
    assert r.returncode == 0, r.stderr
    assert_nothing_left(cli.home)


def test_file_follows_the_nodes_and_refuses_what_would_break_it(tmp_path: Path) -> None:
    """In process: a replaced node (recovery: new address, port) rewrites the entry; an
    address or user with whitespace or pattern characters never reaches the file."""
    from types import SimpleNamespace

    from cloudtrain import sshconfig
    from cloudtrain.errors import UserError
    from cloudtrain.keys import ClusterKeys
    from cloudtrain.schema import NodeRow

    def node(rank: int, host: str, port: int, user: str = "ubuntu") -> NodeRow:
        return NodeRow(cluster="rep", rank=rank, instance_id=f"i-{rank}", host=host, port=port,
                       user=user, internal_ip=host, status="running", root_dir="/r")

    keys = ClusterKeys(tmp_path / "clusters" / "rep" / "ssh")
    handle = SimpleNamespace(name="rep", keys=keys, nodes=[node(0, "10.0.0.1", 22),
                                                            node(1, "10.0.0.2", 22)])
    handle.head = handle.nodes[0]
    home = tmp_path / "home"
    path = sshconfig.write_cluster(home, handle)   # type: ignore[arg-type]
    assert "HostName 10.0.0.2\n    Port 22\n" in path.read_text()
    handle.nodes[1] = node(1, "10.0.0.7", 2222)
    sshconfig.write_cluster(home, handle)   # type: ignore[arg-type]
    text = path.read_text()
    assert "10.0.0.2" not in text and "HostName 10.0.0.7\n    Port 2222\n" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for host, user in (("10.0.0.3 evil", "u"), ("*", "u"), ("h", "a b"), ("h\nHost *", "u")):
        handle.nodes[1] = node(1, host, 22, user)
        with pytest.raises(UserError):
            sshconfig.write_cluster(home, handle)   # type: ignore[arg-type]
        assert path.read_text() == text


def test_launch_with_ssh_config(cli: CLI, tmp_path: Path) -> None:
    home = tmp_path / "user"
    home.mkdir()
    r = cli.run("launch", str(_task(tmp_path, "lsc")), "-y", "--ssh-config", HOME=str(home))
    assert r.returncode == 0, r.stderr
    assert _includes(home / ".ssh" / "config") == 1
    r = _ssh(home, "lsc-1", "true")
    assert r.returncode == 0, r.stderr
    r = cli.run("down", "lsc", "-y")
    assert r.returncode == 0 and not (cli.home / "ssh" / "lsc.conf").exists(), r.stderr
