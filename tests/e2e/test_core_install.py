"""A core-only install (no cloud extra) in its own venv, through its real CLI: every command
that needs a cloud's SDK exits 2 with one paragraph naming the pip line, never a traceback,
and creates nothing; lists of providers say which lack their SDK.

The venv is made once per session by tests/corevenv.py (the wheel of this checkout in a fresh
``python -m venv``: its core dependencies only; about 15 s). pip must reach an index (PyPI, or
the machine's configured one)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from corevenv import core_venv  # noqa: F401  (the session's core-only venv)

AWS_TASK = """\
name: {name}
resources:
  provider: aws
  instance_type: g5.xlarge
  region: us-east-1
  ssh_cidr: 10.0.0.0/8
run: echo hi
"""
PIP_AWS = "pip install 'cloudtrain[aws]'"


@pytest.fixture(scope="session")
def core_python(core_venv: Path) -> Path:  # noqa: F811
    return core_venv / "python"   # the wheel in a venv of its own, no SDK (tests/corevenv.py)


class CoreCLI:
    def __init__(self, python: Path, home: Path) -> None:
        self.python, self.home = python, home

    def run(self, *args: str, cwd: Path | None = None, **extra: str
            ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "CLOUDTRAIN_", "PYTHONPATH"))}
        # credentials present: the SDK is the only thing missing
        env.update({"CLOUDTRAIN_HOME": str(self.home), "NO_COLOR": "1",
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_EC2_METADATA_DISABLED": "true", **extra})
        return subprocess.run([str(self.python), "-m", "cloudtrain", *args], capture_output=True,
                              text=True, timeout=120, env=env, cwd=cwd)

    def names(self) -> list[str]:
        r = self.run("status", "--json")
        assert r.returncode == 0, r.stderr
        return [c["name"] for c in json.loads(r.stdout)]


@pytest.fixture
def core(core_python: Path, tmp_path: Path) -> CoreCLI:
    home = tmp_path / "home"
    home.mkdir()
    return CoreCLI(core_python, home)


def _says_pip_line(r: subprocess.CompletedProcess[str], extra: str = PIP_AWS) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert extra in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "ModuleNotFoundError" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3, r.stderr   # one paragraph


def test_up_and_launch_of_an_aws_task_name_the_extra(core: CoreCLI, tmp_path: Path) -> None:
    task = tmp_path / "t.yaml"
    task.write_text(AWS_TASK.format(name="coreup"))
    for cmd in ("up", "launch"):
        r = core.run(cmd, str(task), "-y")
        _says_pip_line(r)
        assert core.names() == []
        assert not (core.home / "clusters" / "coreup").exists()


def test_down_gc_name_the_extra(core: CoreCLI) -> None:
    _says_pip_line(core.run("down", "x", "--provider", "aws", "-y"))
    _says_pip_line(core.run("gc", "--provider", "aws"))
    r = core.run("gc")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for cloud in ("aws", "azure", "gcp"):
        assert (f"{cloud}: skipped, its SDK is not installed (to include it: pip install "
                f"'cloudtrain[{cloud}]')") in r.stdout + r.stderr


def test_a_recorded_aws_cluster_names_the_extra_and_can_be_forgotten(core: CoreCLI) -> None:
    from cloudtrain.schema import ClusterRow
    from cloudtrain.state import open_state

    now = time.time()
    open_state(core.home).upsert_cluster(ClusterRow(
        name="old", provider="aws", status="INIT", num_nodes=1, created_at=now, updated_at=now,
        region="us-east-1", instance_type="g5.xlarge", hourly_price=1.01))
    r = core.run("down", "old", "-y")
    _says_pip_line(r)
    assert "--forget" in r.stderr and core.names() == ["old"]
    r = core.run("down", "old", "-y", "--forget")
    assert r.returncode == 0 and "aws was not asked" in r.stdout + r.stderr, r.stderr
    assert core.names() == []


def test_provider_lists_say_which_lack_their_sdk(core: CoreCLI, tmp_path: Path) -> None:
    task = tmp_path / "typo.yaml"
    task.write_text("resources:\n  provider: awz\nrun: echo\n")
    r = core.run("up", str(task), "-y")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "Installed providers: local, slurm, ssh." in r.stderr, r.stderr
    assert "Not installed (their SDK is missing): aws, azure, gcp" in r.stderr, r.stderr
    task.write_text("resources:\n  accelerators: A10G:1\nrun: echo\n")   # up picks a cloud
    r = core.run("up", str(task), "-y")
    assert r.returncode == 2 and "not installed: aws, azure, gcp" in r.stderr, r.stderr
    assert "installed without credentials" not in r.stderr, r.stderr


def test_catalog_refresh_aws_keeps_spot_prices_and_names_the_extra(core: CoreCLI) -> None:
    """Refreshing AWS needs no SDK for on-demand prices (plain HTTPS); spot prices need boto3:
    they stay as they were, and the note names the pip line (as without credentials)."""
    from unit.test_catalog_refresh import PriceServer, env_for, seed

    seed(core.home)
    with PriceServer() as server:
        env = env_for(core.home, server)
        r = core.run("catalog", "refresh", "--provider", "aws",
                     **{k: v for k, v in env.items() if k.startswith(("CLOUDTRAIN_", "AWS_"))
                        or k in ("NO_PROXY",)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "spot prices were not refreshed" in r.stderr and PIP_AWS in r.stderr, r.stderr
    assert not server.paths("/ec2")
