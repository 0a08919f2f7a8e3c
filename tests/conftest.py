from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from dockerkit import docker_engine, registry, tiny_image, torch_image  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "tests" / "fixtures" / "demo"


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


needs_sshd = pytest.mark.skipif(shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists(),
                                reason="OpenSSH server not installed")
needs_torch = pytest.mark.skipif(not _has_torch(), reason="PyTorch not installed")
needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="network namespaces need root and iproute2")


class CLI:
    """Runs the real ``cloudtrain`` command line in a subprocess with its own home."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CLOUDTRAIN_HOME": str(self.home), "NO_COLOR": "1", "CLOUDTRAIN_SSH_TIMEOUT": "60",
                    # the automatic preflight (docs/preflight.md) only where a test asks for it
                    "CLOUDTRAIN_AUTO_PREFLIGHT": "0"})
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 300, cwd: Path | None = None,
            **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                              text=True, timeout=timeout, env=self.env(**extra), cwd=cwd)

    def popen(self, *args: str, **extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "cloudtrain", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env(**extra))

    def status(self) -> list[dict[str, object]]:
        import json

        r = self.run("status", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


def processes_with(needle: str) -> list[int]:
    """pids whose command line or environment mentions ``needle``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            data = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            continue
        if needle.encode() in data:
            out.append(int(entry.name))
    return out


def node_bundle(dest: Path) -> None:
    """The node scripts a sweep needs, copied into ``dest`` as the bootstrap bundle ships them
    side by side (pipeline/bootstrap.py): every node/sweep*.py, store.py and queue.py."""
    node = Path(__file__).resolve().parent.parent / "cloudtrain" / "node"
    dest.mkdir(parents=True, exist_ok=True)
    for src in [*sorted(node.glob("sweep*.py")), node / "store.py", node / "queue.py"]:
        (dest / src.name).write_text(src.read_text())


def wait_until(pred, timeout: float, step: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def ct_network_objects() -> set[str]:
    """cloudtrain's namespaces (ct-*) and bridges (ctbr*) that exist now."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = {line.split()[0] for line in ns.splitlines() if line.startswith("ct-")}
    found |= {ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines() if ": ctbr" in ln}
    return found


def assert_nothing_left(home: Path) -> None:
    """No sshd, no process, no node directory of this home's clusters remains."""
    assert wait_until(lambda: not processes_with(str(home)), 10), \
        f"processes left: {processes_with(str(home))}"
    clusters = home / "clusters"
    left = [p for p in clusters.iterdir()] if clusters.exists() else []
    assert not left, f"cluster directories left: {left}"


@pytest.fixture
def cli(tmp_path: Path):  # type: ignore[no-untyped-def]
    home = tmp_path / "home"
    home.mkdir()
    c = CLI(home)
    yield c
    # Whatever a test did, leave nothing running.
    subprocess.run([sys.executable, "-m", "cloudtrain", "down", "-a", "-y"], env=c.env(),
                   capture_output=True, timeout=120)
    for pid in processes_with(str(home)):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.fixture
def demo_dir(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    shutil.copytree(DEMO, d, ignore=shutil.ignore_patterns("cloudtrain-outputs", "__pycache__"))
    return d


# The cloud fixtures the provider tests share: ``aws`` (moto, with the DLAMI images) and
# ``gcp`` (the GCE fake on loopback; nothing may leave loopback), each with a hermetic
# environment and a fresh cloudtrain home. A test module with another setup defines its own.

AWS_REGION = "us-east-1"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    from moto import mock_aws

    from aws_moto import Harness, add_images_to_moto, hermetic_env

    hermetic_env(monkeypatch)
    with mock_aws():
        add_images_to_moto(AWS_REGION)
        yield Harness(tmp_path / "home")


@pytest.fixture
def gcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    pytest.importorskip("google.cloud.compute_v1")
    from gce_fake import GCEFake, Harness, hermetic_env

    hermetic_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake() as fake:
        fake.guard_env(monkeypatch)
        yield Harness(fake, tmp_path / "home")
        # nothing tried to leave loopback (google-auth's own boundary lookup aside)
        assert not [h for h in fake.outside if not h.startswith("iamcredentials.")], fake.outside


def pytest_configure(config: pytest.Config) -> None:
    from skipcheck import register
    register(config)
    # The automatic preflight before a cluster's first multi-node launch (docs/preflight.md)
    # only where a test asks for it (tests/e2e/test_preflight.py), also for the tests that
    # start the CLI themselves: otherwise its seconds before the job (and its processes on
    # the nodes, marked with the cluster) change what a test that times the job sees.
    os.environ.setdefault("CLOUDTRAIN_AUTO_PREFLIGHT", "0")
