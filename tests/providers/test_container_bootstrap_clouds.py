"""A task with ``container:`` on cloud nodes: ``up`` against the moto server (AWS) or the Compute
Engine fake (GCP), whose instances are stand-in sshd nodes (tests/fakes/standin.py, as in
test_aws_cli.py and test_gcp_e2e.py), runs the real bootstrap,
which chooses the host-side runtime: on a node without Docker it installs ``docker.io`` (a
cloud node may be changed; a local or ssh one is only checked), finds the Engine answering,
and installs neither a virtualenv nor PyTorch.

The stand-ins start "without Docker": a ``docker`` on their PATH that is not found until
their ``apt-get`` (a recorder) has installed ``docker.io``; from then on it is the real CLI,
talking to this machine's Engine."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from conftest import needs_sshd

pytest.importorskip("moto")

from test_aws_cli import (LocalNodes, _cloudtrain, _map_when_running, _moto, _tagged,  # noqa: E402,F401
                          aws_task, guarded, moto_server)
from test_gcp_e2e import world  # noqa: E402,F401

pytestmark = [needs_sshd, pytest.mark.e2e]

GCP_TASK = """
name: boxgcp
num_nodes: 2
resources:
  provider: gcp
  region: us-central1
  accelerators: T4:1
  ssh_cidr: 198.51.100.7/32
container:
  image: {image}
workdir: .
run: echo hi
"""
TASK = """
name: boxaws
num_nodes: 2
resources:
  provider: aws
  region: us-east-1
  instance_type: g4dn.xlarge
  ssh_cidr: 127.0.0.1/32
  aws: {{host_key_wait: 0}}
container:
  image: {image}
workdir: .
run: echo hi
"""


def _without_docker(node_dir: Path, real_docker: str) -> None:
    """``docker`` missing on the stand-in until its ``apt-get`` installs docker.io."""
    d = node_dir
    (d / "bin" / "docker").write_text(
        "#!/bin/sh\n"
        f'[ -f "{d}/docker-installed" ] || {{ echo "sh: docker: not found" >&2; exit 127; }}\n'
        f'exec "{real_docker}" "$@"\n')
    (d / "bin" / "apt-get").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{d}/apt.log"\n'
        f'case "$*" in *" docker.io"*) touch "{d}/docker-installed" ;; esac\n')
    for name in ("docker", "apt-get"):
        (d / "bin" / name).chmod(0o755)


def test_up_on_a_cloud_node_without_docker_installs_the_engine_and_no_pytorch(
        guarded: dict[str, str], moto_server: str, tmp_path: Path, docker_engine: str,  # noqa: F811
        tiny_image: str) -> None:
    real_docker = shutil.which("docker")
    assert real_docker
    proj = tmp_path / "proj"
    proj.mkdir()
    task = proj / "task.yaml"
    task.write_text(TASK.format(image=tiny_image))
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    ec2 = _moto(moto_server)
    nodes = LocalNodes(tmp_path / "nodes")
    for n in nodes.nodes:
        _without_docker(n["dir"], real_docker)
    aws_task(task, map_file, nodes)
    nodes.start()
    seen: dict[str, object] = {}
    stop = threading.Event()
    mapper = threading.Thread(target=_map_when_running,
                              args=(ec2, nodes, "boxaws", map_file, seen, stop), daemon=True)
    mapper.start()
    try:
        r = _cloudtrain(env, "up", str(task), "-y", cwd=proj, timeout=300)
        down = _cloudtrain(env, "down", "boxaws", "-y", timeout=300)
    finally:
        stop.set()
        mapper.join(timeout=10)
        nodes.stop()
    assert r.returncode == 0, (r.stderr + r.stdout)[-4000:]
    assert down.returncode == 0, down.stderr[-2000:]
    _chose_docker(r.stderr + r.stdout, [n["dir"] for n in nodes.nodes], docker_engine)
    assert {k: len(v) for k, v in _tagged(ec2, "boxaws").items()}["instances"] == 0


def _chose_docker(out: str, dirs: list[Path], version: str) -> None:
    """Every node installed docker.io (and nothing of Python's) and found its Engine."""
    for d in dirs:
        apt = (d / "apt.log").read_text().splitlines()
        assert "install -y -q --no-install-recommends docker.io" in apt, apt
        assert not (d / "root" / "cloudtrain" / "venv").exists()
    lines = out.splitlines()
    docker = [ln for ln in lines if ln.strip().startswith("docker ")]
    assert len(docker) == len(dirs), out[-4000:]
    assert all(f"INSTALLED  Docker Engine {version} (docker.io)" in ln for ln in docker)
    torch = [ln for ln in lines if ln.strip().startswith("torch ")]
    assert len(torch) == len(dirs) and all("skipped" in ln and "image brings its own PyTorch"
                                           in ln for ln in torch), torch
    assert all("installed docker" in ln for ln in lines if "bootstrapped in" in ln), out[-3000:]


def test_up_on_gcp_nodes_without_docker_installs_the_engine_and_no_pytorch(
        world, tmp_path: Path, docker_engine: str,  # type: ignore[no-untyped-def]  # noqa: F811
        tiny_image: str) -> None:
    cli, env, fake, nodes, _ = world
    real_docker = shutil.which("docker")
    assert real_docker
    for d in nodes.dirs:
        _without_docker(d, real_docker)
    proj = tmp_path / "proj"
    proj.mkdir()
    task = proj / "task.yaml"
    task.write_text(GCP_TASK.format(image=tiny_image))
    nodes.use(task)
    r = cli.run("up", str(task), "-y", cwd=proj, timeout=300, **env)
    assert r.returncode == 0, (r.stderr + r.stdout)[-4000:]
    _chose_docker(r.stderr + r.stdout, nodes.dirs, docker_engine)
    down = cli.run("down", "boxgcp", "-y", timeout=300, **env)
    assert down.returncode == 0, down.stderr[-2000:]
    assert fake.empty(), fake.ours()
