"""provider: slurm with the login node reached over SSH (a private sshd on loopback whose
sessions see the test cluster's SLURM_CONF, as a site's login node sees its own): up, status
--refresh and down run every Slurm command there; a login node whose host key changed is
refused, with nothing queued."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import CLI, needs_sshd
from slurmkit import SlurmCluster, _free_port, needs_slurm, slurm, slurm_cluster  # noqa: F401

pytestmark = [needs_slurm, needs_sshd, pytest.mark.e2e]


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


class LoginNode:
    def __init__(self, root: Path, slurm: SlurmCluster) -> None:
        self.root, self.port = root, _free_port()
        root.mkdir()
        self.key = root / "id_user"
        (root / "authorized_keys").write_text(keygen(self.key) + "\n")
        self.slurm = slurm
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        host_key = self.root / "host_key"
        if not host_key.exists():
            keygen(host_key)
        cfg = self.root / "sshd_config"
        cfg.write_text(f"""Port {self.port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {self.root}/sshd.pid
AuthorizedKeysFile {self.root}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
SetEnv SLURM_CONF={self.slurm.conf}
""")
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(cfg)],
                                     stderr=open(self.root / "sshd.log", "ab"))
        deadline = time.time() + 15
        while time.time() < deadline:
            r = subprocess.run(["ssh-keyscan", "-p", str(self.port), "127.0.0.1"],
                               capture_output=True, text=True)
            if r.stdout.strip():
                return
            time.sleep(0.2)
        raise AssertionError("the login sshd did not start: "
                             + (self.root / "sshd.log").read_text())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def login(slurm: SlurmCluster, tmp_path: Path) -> Iterator[LoginNode]:
    node = LoginNode(tmp_path / "login", slurm)
    node.start()
    yield node
    node.stop()


def task(tmp_path: Path, login: LoginNode) -> Path:
    f = tmp_path / "remote.yaml"
    f.write_text(f"""name: remote
num_nodes: 2
max_hours: 0.25
resources:
  provider: slurm
  accelerators: H100:2
  slurm:
    login: root@127.0.0.1:{login.port}
    identity_file: {login.key}
run: echo hi
""")
    return f


def test_up_status_down_over_ssh(slurm: SlurmCluster, login: LoginNode, cli: CLI,
                                 tmp_path: Path) -> None:
    # sbatch is only reachable through the login node: this process's SLURM_CONF is hidden
    hidden = {"SLURM_CONF": str(tmp_path / "no-such-slurm.conf")}
    r = cli.run("up", str(task(tmp_path, login)), "-y", **hidden)
    assert r.returncode == 0, r.stderr
    (job,) = slurm.jobs()
    assert job["name"] == "ct-remote" and job["state"] == "RUNNING"
    st = cli.run("status", "--refresh", **hidden)
    assert f"remote: Slurm job {job['id']} RUNNING on n[1-2]" in st.stdout, st.stdout + st.stderr
    # the login node's host key was learned on first contact, in the cluster's own file
    learned = cli.home / "clusters" / "remote" / "slurm-login-known_hosts"
    found = subprocess.run(["ssh-keygen", "-F", f"[127.0.0.1]:{login.port}", "-f",
                            str(learned)], capture_output=True, text=True)
    host_pub = (login.root / "host_key.pub").read_text().split()[1]
    assert found.returncode == 0 and host_pub in found.stdout, found.stdout
    d = cli.run("down", "remote", "-y", **hidden)
    assert d.returncode == 0, d.stderr
    assert slurm.jobs() == []


def test_a_changed_login_host_key_is_refused(slurm: SlurmCluster, login: LoginNode, cli: CLI,
                                             tmp_path: Path) -> None:
    f = task(tmp_path, login)
    assert cli.run("up", str(f), "-y").returncode == 0
    assert cli.run("down", "remote", "-y").returncode == 0
    known = cli.home / "clusters" / "remote"
    known.mkdir(parents=True, exist_ok=True)
    # a pin kept from before, of another key: the login node now presents a different one
    (known / "slurm-login-known_hosts").write_text(
        f"[127.0.0.1]:{login.port} {keygen(tmp_path / 'other')}\n")
    r = cli.run("up", str(f), "-y")
    assert r.returncode != 0
    assert "its host key is not the one pinned (Host key verification failed.)" in r.stderr, \
        r.stderr
    assert slurm.jobs() == []
