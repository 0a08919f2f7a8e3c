"""``resources.ssh_proxy`` through the real CLI on local sshd nodes: every connection to the
nodes (cloudtrain's OpenSSH masters, paramiko when multiplexing is off, rsync's ssh,
``cloudtrain ssh``, plain ``ssh NAME`` and port forwards through the cluster's generated
config, and status's live check of the ssh provider's hosts) goes through the proxy, in both
forms:

- a ProxyCommand: a relay (tests/fakes/ssh_relay.py), which records each ``%h %p`` it is asked
  for (with the processes that asked and the local port it connected from) and relays to the
  node, or to the real address of an address only it knows;
- a ProxyJump spec: a jump host that is a real sshd (the local provider's sshd helper) whose
  only authorised key is one the test makes. The jump host is reached as the user's own
  ``ssh bastion`` reaches it: OpenSSH takes ``~/.ssh/config`` from the password database, not
  from $HOME, so the test stands in for the user's config with a small ``ssh`` on PATH that
  passes ``-F <the test's config>`` (cloudtrain's own node connections give ``-F /dev/null``
  later on their command line, which wins); the user's real ~/.ssh is not touched.

A malformed value exits 2 naming the field, and creates nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("ssh") is None or shutil.which("rsync") is None,
                                 reason="needs OpenSSH's client and rsync")]

RELAY = Path(__file__).resolve().parent.parent / "fakes" / "ssh_relay.py"


def _project(tmp_path: Path, name: str, proxy: str) -> Path:
    wd = tmp_path / "proj"
    wd.mkdir(exist_ok=True)
    (wd / "data.txt").write_text("sent by rsync\n")
    task = tmp_path / f"{name}.yaml"
    task.write_text(f"name: {name}\nnum_nodes: 2\nworkdir: ./proj\n"
                    f"resources:\n  provider: local\n  ssh_proxy: {proxy!r}\n"
                    "run: 'cat data.txt; echo conn=$SSH_CONNECTION'\n")
    return task


def _relay(tmp_path: Path, where: dict[str, tuple[str, int]] | None = None) -> tuple[str, Path]:
    """The relay as a proxy command, and its log; ``where``: addresses only it knows."""
    log = tmp_path / "relay.log"
    if where is None:
        return f"{sys.executable} {RELAY} %h %p {log}", log
    (tmp_path / "where.json").write_text(json.dumps(where))
    return f"{sys.executable} {RELAY} %h %p {log} {tmp_path / 'where.json'}", log


def _entries(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log.read_text().splitlines()] if log.exists() else []


def _nodes(cli: CLI) -> list[tuple[str, str]]:
    [cluster] = cli.status()
    nodes = cluster["nodes"]
    assert isinstance(nodes, list)
    return [(str(n["host"]), str(n["port"])) for n in nodes]


def _client_ports(out: str) -> set[str]:
    """The client-side ports of the SSH connections the job's commands came over."""
    return {ln.split("conn=")[1].split()[1] for ln in out.splitlines() if "conn=" in ln}


def _greet(server: socket.socket) -> None:
    """Answer every connection (the forward's readiness check among them) with one line."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.sendall(b"through the relay")


def _ssh_through_config(cli: CLI, name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    conf = cli.home / "ssh" / f"{name}.conf"
    return subprocess.run(["ssh", "-F", str(conf), name, *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, **env})


def test_a_proxy_command_carries_every_connection_and_ssh_name(cli: CLI, tmp_path: Path) -> None:
    proxy, log = _relay(tmp_path)
    task = _project(tmp_path, "relayed", proxy)
    r = cli.run("launch", str(task), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("sent by rsync") == 2, r.stdout          # rsync's files arrived
    nodes = _nodes(cli)
    seen = _entries(log)
    # One master per node, opened by OpenSSH through the relay, for that node's address.
    assert {(e[0], e[1]) for e in seen} == set(nodes), seen
    assert all(e[3] == "ssh" for e in seen), seen
    # The job's commands came over the relay's connections (their client ports are the
    # relay's), and rsync rode on those same masters.
    assert _client_ports(r.stdout) <= {e[2] for e in seen}, (r.stdout, seen)
    assert len(_client_ports(r.stdout)) == 2

    # Plain ssh through the generated config goes through the same proxy.
    conf = (cli.home / "ssh" / "relayed.conf").read_text()
    assert conf.count(f"ProxyCommand {proxy}") == 2, conf
    before = len(seen)
    done = _ssh_through_config(cli, "relayed", "echo conn=$SSH_CONNECTION")
    assert done.returncode == 0, done.stderr
    [entry] = _entries(log)[before:]
    assert (entry[0], entry[1], entry[3]) == (*nodes[0], "ssh")
    assert _client_ports(done.stdout) == {entry[2]}, (done.stdout, entry)
    # So does 'cloudtrain ssh NAME' (connecting on its own: no master to ride on).
    before = len(_entries(log))
    done = subprocess.run([sys.executable, "-m", "cloudtrain", "ssh", "relayed", "--node", "1"],
                          input="echo conn=$SSH_CONNECTION\n", capture_output=True, text=True,
                          timeout=60, env=cli.env(CLOUDTRAIN_SSH_PERSIST="0"))
    assert done.returncode == 0, done.stderr
    [entry] = _entries(log)[before:]
    assert (entry[0], entry[1], entry[3]) == (*nodes[1], "ssh")
    assert _client_ports(done.stdout) == {entry[2]}, (done.stdout, entry)

    # A port forward (ssh -F <cluster file>) goes through it as well.
    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=_greet, args=(server,), daemon=True).start()
        remote, local = server.getsockname()[1], _free_port()
        before = len(_entries(log))
        fwd = cli.run("forward", "relayed", f"{remote}:{local}", "--background")
        assert fwd.returncode == 0, fwd.stderr
        with socket.create_connection(("127.0.0.1", local), timeout=10) as c:
            assert c.recv(64) == b"through the relay"
        assert [(e[0], e[1], e[3]) for e in _entries(log)[before:]] == [(*nodes[0], "ssh")]
        assert cli.run("forward", "--stop", "relayed").returncode == 0

    # Later commands have no task file: they remember the proxy with the cluster.
    before = len(_entries(log))
    r = cli.run("exec", "relayed", "--", "echo conn=$SSH_CONNECTION", CLOUDTRAIN_SSH_PERSIST="0")
    assert r.returncode == 0, r.stderr
    later = _entries(log)[before:]
    assert {(e[0], e[1]) for e in later} == set(nodes), later
    assert _client_ports(r.stdout) <= {e[2] for e in later}, (r.stdout, later)
    assert cli.run("down", "relayed", "-y").returncode == 0
    assert_nothing_left(cli.home)


def test_without_multiplexing_rsync_and_paramiko_each_go_through_the_proxy(
        cli: CLI, tmp_path: Path) -> None:
    proxy, log = _relay(tmp_path)
    task = _project(tmp_path, "direct", proxy)
    r = cli.run("launch", str(task), "--down", cwd=tmp_path, CLOUDTRAIN_SSH_PERSIST="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("sent by rsync") == 2, r.stdout
    seen = _entries(log)
    targets = {(e[0], e[1]) for e in seen}
    assert len(targets) == 2, seen
    for target in targets:
        mine = [e for e in seen if (e[0], e[1]) == target]
        # rsync's own ssh asked for this node (ssh's parent is rsync) ...
        assert any(e[3] == "ssh" and e[4] == "rsync" for e in mine), mine
        # ... and cloudtrain's paramiko connection (the relay is its own child) too.
        assert any(e[3].startswith("python") for e in mine), mine
    assert _client_ports(r.stdout) <= {e[2] for e in seen}, (r.stdout, seen)
    assert_nothing_left(cli.home)


def test_nodes_at_addresses_only_the_proxy_knows_are_reached_and_shown_running(
        cli: CLI, tmp_path: Path) -> None:
    """The ssh provider's hosts are names no resolver knows (node-N.invalid; their private
    addresses, which the nodes use among themselves, are the stand-ins'): only the proxy can
    reach them, so every command that works went through it; status's live check of
    those hosts (an SSH banner) goes through it too."""
    t = tmp_path / "stand-ins.yaml"
    t.write_text("name: stand-ins\nnum_nodes: 2\nrun: 'true'\n")
    assert cli.run("up", str(t), "--no-bootstrap").returncode == 0
    real = _nodes(cli)
    where = {f"node-{i}.invalid:22": (h, int(p)) for i, (h, p) in enumerate(real)}
    proxy, log = _relay(tmp_path, where)
    key = cli.home / "clusters" / "stand-ins" / "ssh" / "id_ed25519"
    entries = "\n".join(f"      - {{address: node-{i}.invalid, internal_ip: {h}, "
                        f"identity_file: {key}}}" for i, (h, _) in enumerate(real))
    task = tmp_path / "hidden.yaml"
    task.write_text(f"name: hidden\nnum_nodes: 2\nworkdir: ./proj\nresources:\n  provider: ssh\n"
                    f"  ssh_proxy: {proxy!r}\n  ssh:\n    hosts:\n{entries}\n"
                    f"bootstrap:\n  python: {sys.executable}\nrun: 'cat data.txt'\n")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "data.txt").write_text("sent by rsync\n")
    r = cli.run("launch", str(task), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("sent by rsync") == 2, r.stdout
    assert {(e[0], e[1]) for e in _entries(log)} == {("node-0.invalid", "22"),
                                                      ("node-1.invalid", "22")}
    st = cli.run("status", "hidden", "--json")
    assert st.returncode == 0, st.stderr
    [c] = json.loads(st.stdout)
    assert [n["status"] for n in c["nodes"]] == ["running", "running"], c
    r = cli.run("exec", "hidden", "--", "echo reached", CLOUDTRAIN_SSH_PERSIST="0")
    assert r.returncode == 0 and r.stdout.count("reached") == 2, r.stderr
    assert cli.run("down", "hidden", "-y").returncode == 0
    assert cli.run("down", "stand-ins", "-y").returncode == 0
    assert_nothing_left(cli.home)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _jump_host(tmp_path: Path) -> tuple[Path, Path, int]:
    """A real sshd on 127.0.0.1 that only the test's jump key may log in to (and forward
    through); returns (its folder, the jump key, its port)."""
    from cloudtrain.keys import ensure_keys
    from cloudtrain_provisioners.local import sshd

    d = tmp_path / "jump"
    (d / "root").mkdir(parents=True)
    key = ensure_keys(d / "client", comment="jump-test")     # an ed25519 key pair, mode 600
    (d / "authorized_keys").write_text(key.public_key() + "\n")
    host_pub = sshd.write_host_key(d / "ssh_host_ed25519_key")
    port = _free_port()
    user = os.environ.get("USER") or __import__("getpass").getuser()
    cfg = sshd.write_config(d, address="127.0.0.1", port=port, user=user,
                            marker="ct-proxy-test-jump", home=d / "root")
    cfg.write_text(cfg.read_text().replace("LogLevel ERROR", "LogLevel VERBOSE"))
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    sshd.start(d)
    return d, key.private_key, port


def _user_ssh(tmp_path: Path, jump: Path, key: Path, port: int) -> Path:
    """The stand-in for the user's ~/.ssh/config (a 'bastion' entry) and the ``ssh`` on PATH
    that reads it, recording each invocation."""
    user = os.environ.get("USER") or __import__("getpass").getuser()
    cfg = tmp_path / "user_ssh_config"
    cfg.write_text(f"Host bastion\n    HostName 127.0.0.1\n    Port {port}\n    User {user}\n"
                   f"    IdentityFile {key}\n    IdentitiesOnly yes\n"
                   f"    UserKnownHostsFile {jump / 'known_hosts'}\n"
                   "    GlobalKnownHostsFile /dev/null\n    StrictHostKeyChecking yes\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'ssh.log'}\n"
                       f"exec {shutil.which('ssh')} -F {cfg} \"$@\"\n")
    wrapper.chmod(0o755)
    return bin_dir


def test_a_jump_host_is_reached_with_the_users_own_ssh_config(cli: CLI, tmp_path: Path) -> None:
    from cloudtrain_provisioners.local import sshd

    jump, key, port = _jump_host(tmp_path)
    try:
        path = f"{_user_ssh(tmp_path, jump, key, port)}:{os.environ['PATH']}"
        task = _project(tmp_path, "jumped", "bastion")
        r = cli.run("launch", str(task), cwd=tmp_path, PATH=path, CLOUDTRAIN_SSH_PERSIST="0")
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("sent by rsync") == 2, r.stdout
        nodes = _nodes(cli)
        calls = (tmp_path / "ssh.log").read_text().splitlines()
        hops = [ln for ln in calls if ln.startswith("-o BatchMode=yes -W ")]
        # Each node was reached through 'ssh -W [host]:port bastion', for paramiko's
        # connections and for rsync's (several hops per node), never with the cluster's key.
        for host, p in nodes:
            assert sum(ln.endswith(f"-W [{host}]:{p} bastion") for ln in hops) >= 2, hops
        assert not any("id_ed25519" in ln for ln in hops), hops
        accepted = (jump / "sshd.log").read_text().count("Accepted publickey")
        assert accepted >= len(hops), (jump / "sshd.log").read_text()

        # ssh NAME through the generated config also goes through the bastion ...
        assert "ProxyCommand ssh -W '[%h]:%p' bastion" in \
            (cli.home / "ssh" / "jumped.conf").read_text()
        done = _ssh_through_config(cli, "jumped", "echo", "reached", PATH=path)
        assert done.returncode == 0 and done.stdout == "reached\n", done.stderr
        # ... and cannot reach the node without it.
        sshd.stop(jump)
        assert wait_until(lambda: sshd.pid(jump) is None, 10)
        assert _ssh_through_config(cli, "jumped", "true", PATH=path).returncode != 0
        sshd.start(jump)
        assert cli.run("down", "jumped", "-y", PATH=path,
                       CLOUDTRAIN_SSH_PERSIST="0").returncode == 0
        assert_nothing_left(cli.home)
    finally:
        sshd.stop(jump)


@pytest.mark.parametrize("value", ["bastion:0", "'ssh -W %h bastion'", "-oProxyCommand=x",
                                   "[bastion]", "'a b'", '"nc %h %p\\a"'])
def test_a_malformed_proxy_exits_2_naming_the_field_and_creates_nothing(
        cli: CLI, tmp_path: Path, value: str) -> None:
    task = tmp_path / "bad.yaml"
    task.write_text(f"name: bad\nresources:\n  provider: local\n  ssh_proxy: {value}\nrun: 'true'\n")
    before = sorted(cli.home.rglob("*"))
    r = cli.run("launch", str(task), cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "field 'resources.ssh_proxy'" in r.stderr and "%h and %p" in r.stderr, r.stderr
    assert "[user@]host[:port]" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.rstrip("\n").count("\n") <= 1, r.stderr
    assert sorted(cli.home.rglob("*")) == before
