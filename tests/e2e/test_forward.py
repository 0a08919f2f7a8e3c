"""Issue 14: ports through SSH, through the real CLI against local nodes: ``cloudtrain
forward`` (until Ctrl-C, and in the background: listed, stopped, stopped by ``down``) serving
a real HTTP response from a server bound to the node's 127.0.0.1, a local port in use (exit 2),
and ``cloudtrain tensorboard`` end to end (TensorBoard is a dev extra: the local nodes' Python
is this virtualenv)."""

from __future__ import annotations

import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str = "/") -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return resp.status, resp.read().decode(errors="replace")


def _serves(port: int, path: str = "/") -> bool:
    try:
        return _get(port, path)[0] == 200
    except OSError:
        return False


def _tensorboards(cli: CLI) -> list[int]:
    """TensorBoard servers this home's nodes run (not their data-server helpers)."""
    out = []
    for pid in processes_with(str(cli.home)):
        try:
            if b"tensorboard.main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def _task(d: Path, name: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local}}\nrun: 'true'\n")
    return p


@pytest.fixture
def cluster(cli: CLI, tmp_path: Path) -> str:
    r = cli.run("up", str(_task(tmp_path, "fw")), "-y", "--no-ssh-config")
    assert r.returncode == 0, r.stderr
    return "fw"


def test_forward_serves_the_heads_http_server(cli: CLI, cluster: str, tmp_path: Path) -> None:
    www = tmp_path / "www"
    www.mkdir()
    (www / "hello.txt").write_text("served by the head\n")
    node_port = _free_port()
    # a server only the node itself can reach: bound to its 127.0.0.1
    r = cli.run("exec", cluster, "--node", "0", "--",
                f"setsid nohup python3 -m http.server --bind 127.0.0.1 --directory {www} "
                f"{node_port} > /dev/null 2>&1 < /dev/null &")
    assert r.returncode == 0, r.stderr
    local = _free_port()
    assert not _serves(local, "/hello.txt")

    # until Ctrl-C
    proc = cli.popen("forward", cluster, f"{node_port}:{local}")
    try:
        assert wait_until(lambda: _serves(local, "/hello.txt"), 30), proc.stderr
        assert _get(local, "/hello.txt") == (200, "served by the head\n")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""   # Ctrl-C: a normal end
    assert wait_until(lambda: not _serves(local, "/hello.txt"), 10)

    # the local port in use: exit 2, nothing started
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # the port is in TIME_WAIT
        busy.bind(("127.0.0.1", local))
        busy.listen()
        r = cli.run("forward", cluster, f"{node_port}:{local}")
        assert r.returncode == 2 and f"Local port {local}" in r.stderr, r.stderr
    for bad in ("http", "0", "70000", "80:81:82"):
        r = cli.run("forward", cluster, bad)
        assert r.returncode == 2 and "PORT" in r.stderr and "Traceback" not in r.stderr
    r = cli.run("forward", cluster, "8080", "--node", "7")
    assert r.returncode == 2 and "--node 7" in r.stderr, r.stderr

    # in the background: listed, served, stopped
    bg = _free_port()
    r = cli.run("forward", cluster, f"{node_port}:{bg}", "--background")
    assert r.returncode == 0, r.stderr
    assert _get(bg, "/hello.txt") == (200, "served by the head\n")
    r = cli.run("forward", "--list")
    assert r.returncode == 0 and f"127.0.0.1:{bg} -> {node_port}" in r.stdout, r.stdout + r.stderr
    pid = int(r.stdout.split("pid ")[1].split()[0])
    r = cli.run("forward", "--stop", cluster)
    assert r.returncode == 0 and "Stopped 1 forward" in r.stderr, r.stderr
    assert wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10)
    assert not _serves(bg, "/hello.txt")
    assert "No background forwards" in cli.run("forward", "--list").stderr

    # down stops the cluster's background forwards
    r = cli.run("forward", cluster, f"{node_port}:{bg}", "--background")
    assert r.returncode == 0, r.stderr
    r = cli.run("down", cluster, "-y")
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: not _serves(bg, "/hello.txt"), 10)
    assert not list((cli.home / "forwards").glob("*.json"))
    assert_nothing_left(cli.home)


def test_tensorboard_started_on_the_head_and_forwarded(cli: CLI, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    task = tmp_path / "tb.yaml"
    task.write_text("name: tb\nnum_nodes: 1\nresources: {provider: local}\nrun: 'true'\n")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 0, r.stderr
    port = _free_port()
    t0 = time.monotonic()
    r = cli.run("tensorboard", "tb", "--logdir", "runs", "--port", str(port), "--background",
                timeout=200)
    assert r.returncode == 0, r.stderr
    started = time.monotonic() - t0
    assert f"http://127.0.0.1:{port}/" in r.stdout
    status, body = _get(port, "/")
    assert status == 200 and "tensorboard" in body.lower()
    tb = _tensorboards(cli)
    assert len(tb) == 1, tb
    # a second call finds it running: no second TensorBoard
    r = cli.run("forward", "--stop", "tb")
    assert r.returncode == 0
    port2 = _free_port()
    r = cli.run("tensorboard", "tb", "--port", str(port2), "--background", timeout=200)
    assert r.returncode == 0, r.stderr
    assert _tensorboards(cli) == tb
    print(f"tensorboard: started and forwarded in {started:.1f}s")
    r = cli.run("down", "tb", "-y")
    assert r.returncode == 0, r.stderr
    assert_nothing_left(cli.home)


def test_tensorboard_missing_says_how_to_add_it(cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "notb.yaml"
    task.write_text("name: notb\nnum_nodes: 1\nresources: {provider: local}\nrun: 'true'\n")
    r = cli.run("up", str(task), "-y", "--no-bootstrap")   # no Python recorded for the node
    assert r.returncode == 0, r.stderr
    r = cli.run("tensorboard", "notb", "--port", str(_free_port()))
    assert r.returncode == 2, r.stderr
    assert "no Python recorded" in r.stderr and "tensorboard in the task's setup" in r.stderr
    assert "Traceback" not in r.stderr


def test_tensorboard_not_in_the_nodes_python_says_how_to_add_it(cli: CLI, tmp_path: Path) -> None:
    """The node's Python (a wrapper around this virtualenv's, with torch) cannot import
    tensorboard: exit 2 with the fix, and nothing is started."""
    block = tmp_path / "block" / "tensorboard"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('no tensorboard here')\n")
    fake = tmp_path / "fakebin"
    fake.mkdir()
    wrapper = fake / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={block.parent} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    task = tmp_path / "notb2.yaml"
    task.write_text(f"name: notb2\nnum_nodes: 1\nrun: 'true'\n"
                    f"resources:\n  provider: local\n  local: {{python: {wrapper}}}\n")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 0, r.stderr
    r = cli.run("tensorboard", "notb2", "--port", str(_free_port()))
    assert r.returncode == 2, r.stderr
    assert f"TensorBoard is not installed in the Python of 'notb2' node 0 ({fake})" in r.stderr
    assert "setup" in r.stderr and "Traceback" not in r.stderr
    assert not _tensorboards(cli)
