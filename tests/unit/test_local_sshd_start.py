"""The local provider's node is up only once its sshd is: sshd's parent returns before the
daemon writes its pid file, and a node read in between was recorded as 'stopped' (a fresh
cluster's node shown stopped by 'status' right after a successful launch, under load)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import needs_sshd

pytestmark = needs_sshd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _slow_sshd(bin_dir: Path, delay: float) -> None:
    """An ``sshd`` on PATH that returns at once and starts the real one ``delay`` s later
    (as a loaded machine's daemon may write its pid file well after its parent exits)."""
    real = "/usr/sbin/sshd"
    bin_dir.mkdir()
    f = bin_dir / "sshd"
    f.write_text(f"#!/bin/sh\n( sleep {delay}; exec {real} \"$@\" ) >/dev/null 2>&1 &\nexit 0\n")
    f.chmod(0o755)


def test_a_started_node_reads_as_running_at_once(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain_provisioners.local import sshd

    _slow_sshd(tmp_path / "bin", 0.5)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    d = tmp_path / "node"
    (d / "root").mkdir(parents=True)
    sshd.write_host_key(d / "ssh_host_ed25519_key")
    user = os.environ.get("USER") or __import__("getpass").getuser()
    sshd.write_config(d, address="127.0.0.1", port=_free_port(), user=user,
                      marker="ct-start-test", home=d / "root")
    try:
        sshd.start(d)
        assert sshd.pid(d) is not None       # before the fix: None for the first ~0.5 s
    finally:
        subprocess.run(["sh", "-c", f"kill $(cat {d / 'sshd.pid'}) 2>/dev/null"], check=False)


def test_an_sshd_that_never_writes_its_pid_is_an_error_that_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.errors import ProviderError
    from cloudtrain_provisioners.local import sshd

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sshd").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "sshd").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(sshd, "START_WAIT_S", 0.5)
    d = tmp_path / "node"
    d.mkdir()
    with pytest.raises(ProviderError, match="sshd.pid"):
        sshd.start(d)
