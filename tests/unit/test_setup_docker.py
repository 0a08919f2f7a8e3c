"""scripts/setup.sh --tests and Docker: on a machine without it, apt installs the Engine, the
registry, htpasswd and debootstrap, and the Engine is started by scripts/dockerd.sh (never by
apt); an Engine that cannot start stops setup with what to do; plain setup leaves Docker alone.

As in test_setup_script.py, the script runs on a copy of its folder with stubs: apt-get,
``id`` (root) and dockerd.sh record what they were asked, and PATH holds only the host tools
the script itself uses, so that Docker's commands are missing whatever this machine has."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_setup_script import _exe, tree  # noqa: F401 (the fixture)

HOST_TOOLS = ("bash", "mktemp", "cp", "rm", "sed", "tail", "cat", "env", "chmod", "touch",
              "mkdir", "seq", "dirname", "printf")


@pytest.fixture
def bare(tree: Path) -> Path:  # noqa: F811
    """``tree`` on a PATH with no Docker, no registry, no htpasswd, no debootstrap."""
    tmp = tree.parent
    host = tmp / "hostbin"
    host.mkdir()
    for tool in HOST_TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (host / tool).symlink_to(found)
    sysbin = tmp / "sysbin"
    _exe(sysbin / "id", "#!/bin/sh\necho 0\n")
    _exe(sysbin / "apt-get", '#!/bin/sh\necho "$*" >>"$STUB_APT"\n'
         '[ ! -x "$CLOUDTRAIN_POLICY_RC_D" ] || "$CLOUDTRAIN_POLICY_RC_D" docker start '
         '|| echo "policy $?" >>"$STUB_APT"\n')
    _exe(sysbin / "npm", "#!/bin/sh\nexit 0\n")
    _exe(tree / "scripts" / "dockerd.sh",
         '#!/bin/sh\necho started >>"$STUB_DOCKERD"\n'
         'if [ -n "$STUB_DOCKERD_FAIL" ]; then echo "dockerd: did not answer" >&2; exit 1; fi\n'
         'echo "dockerd: started (log: /tmp/x.log)"\n')
    return tree


def _setup(root: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    tmp = root.parent
    env = {k: v for k, v in os.environ.items() if k != "CLOUDTRAIN_TORCH_INDEX"}
    env.update({"PATH": f"{tmp / 'sysbin'}:{tmp / 'hostbin'}", "TMPDIR": str(tmp),
                "STUB_CALLS": str(tmp / "calls"), "STUB_INSTALLED": str(tmp / "installed"),
                "STUB_APT": str(tmp / "apt"), "STUB_DOCKERD": str(tmp / "dockerd"),
                "STUB_DOCKERD_FAIL": "", "CLOUDTRAIN_POLICY_RC_D": str(tmp / "policy-rc.d"),
                **extra})
    return subprocess.run([str(tmp / "hostbin" / "bash"), str(root / "scripts" / "setup.sh"),
                           *args], capture_output=True, text=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)


def _installed(root: Path) -> list[str]:
    apt = root.parent / "apt"
    lines = apt.read_text().splitlines() if apt.exists() else []
    return [w for line in lines if line.startswith("install") for w in line.split()[2:]]


def test_tests_setup_installs_docker_and_starts_its_engine(bare: Path) -> None:
    r = _setup(bare, "--tests")
    assert r.returncode == 0, r.stdout + r.stderr
    wanted = {"docker.io", "docker-registry", "apache2-utils"}
    assert wanted <= set(_installed(bare)), _installed(bare)
    if not Path("/usr/sbin/debootstrap").exists():
        assert "debootstrap" in _installed(bare)
    assert (bare.parent / "dockerd").read_text() == "started\n"
    # apt ran with a policy-rc.d that refuses to start services, removed afterwards
    apt = (bare.parent / "apt").read_text().splitlines()
    assert apt[-2].startswith("install") and apt[-1] == "policy 101", apt
    assert not (bare.parent / "policy-rc.d").exists()
    assert r.stdout.splitlines() == ["dockerd: started (log: /tmp/x.log)",
                                     "setup: ready (cloudtrain 0.1.0 torch 2.13.0+cpu)"]


def test_an_engine_that_will_not_start_stops_setup_saying_what_to_do(bare: Path) -> None:
    r = _setup(bare, "--tests", STUB_DOCKERD_FAIL="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "setup: ready" not in r.stdout
    assert "dockerd: did not answer" in r.stderr
    assert "no Docker Engine answers" in r.stderr and "bash scripts/dockerd.sh" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_policy_in_place_is_left_as_it_is(bare: Path) -> None:
    _exe(bare.parent / "policy-rc.d", "#!/bin/sh\nexit 0\n")
    r = _setup(bare, "--tests")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (bare.parent / "policy-rc.d").read_text() == "#!/bin/sh\nexit 0\n"
    assert "policy 101" not in (bare.parent / "apt").read_text()


def test_plain_setup_leaves_docker_alone(bare: Path) -> None:
    r = _setup(bare)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not {"docker.io", "docker-registry", "apache2-utils"} & set(_installed(bare))
    assert not (bare.parent / "dockerd").exists()
    assert r.stdout.splitlines() == ["setup: ready (cloudtrain 0.1.0 torch 2.13.0+cpu)"]
