"""``up`` of a task with ``container:`` on local nodes (real sshd, this machine's Docker Engine):
bootstrap looks at the host side only (the Engine found, no GPU so no toolkit) and leaves
PyTorch to the image; the same cluster brought up for a task without a container is
bootstrapped again, the usual way."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd

pytestmark = [needs_sshd, pytest.mark.e2e]

TASK = """
name: boxlocal
num_nodes: 2
resources:
  provider: local
{container}workdir: .
run: echo hi
"""


def _steps(out: str, name: str) -> list[str]:
    return [ln.strip() for ln in out.splitlines() if ln.strip().startswith(name + " ")]


def test_up_with_a_container_checks_the_host_side_and_installs_no_pytorch(
        cli: CLI, tmp_path: Path, docker_engine: str, tiny_image: str) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    boxed = proj / "boxed.yaml"
    boxed.write_text(TASK.format(container=f"container:\n  image: {tiny_image}\n"))
    plain = proj / "plain.yaml"
    plain.write_text(TASK.format(container=""))

    r = cli.run("up", str(boxed), "-y", cwd=proj)
    out = r.stderr + r.stdout
    assert r.returncode == 0, out
    docker = _steps(out, "docker")
    assert len(docker) == 2 and all(f"found      Docker Engine {docker_engine}" in d
                                    for d in docker), out
    assert [s.split()[2] for s in _steps(out, "container-toolkit")] == ["skipped"] * 2
    torch = _steps(out, "torch")
    assert len(torch) == 2 and all("image brings its own PyTorch" in t for t in torch), out
    assert out.count("installed nothing") == 2

    # the same nodes for a task without a container: bootstrapped again, no docker step
    r = cli.run("up", str(plain), "-y", cwd=proj)
    out = r.stderr + r.stdout
    assert r.returncode == 0, out
    assert "Bootstrapping" in out and not _steps(out, "docker"), out
    assert all("image brings" not in t for t in _steps(out, "torch")), out

    down = cli.run("down", "boxlocal", "-y")
    assert down.returncode == 0, down.stderr
    assert_nothing_left(cli.home)
