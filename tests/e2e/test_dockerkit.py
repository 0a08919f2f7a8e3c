"""The Docker fixtures the container tests stand on (tests/dockerkit.py): the images run what
the tests run in them, the registry refuses strangers and gives the digest the Engine pulls,
and a machine without an Engine skips with a reason CI refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from dockerkit import (Registry, docker, machine_lock, run_registry, tiny_content, tiny_tag,
                       torch_tag)

REPO = Path(__file__).resolve().parents[2]


def test_tiny_image_runs_a_shell_and_sleep_as_any_user_and_is_small(tiny_image: str) -> None:
    r = docker("run", "--rm", "--network", "host", "--user", "4321:4321", tiny_image, "sh", "-c",
               "sleep 0.1 && id -u && touch /tmp/f && ls /tmp && echo done")
    assert r.stdout.split() == ["4321", "f", "done"], r.stdout
    size = int(docker("image", "inspect", "--format", "{{.Size}}", tiny_image).stdout)
    assert size < 20_000_000, f"the tiny image is {size} bytes"
    # its tag is its content's: the same host files give the same tag
    assert tiny_tag(tiny_content()) == tiny_image


def test_torch_image_imports_torch_and_numpy_and_its_tag_is_the_recipes(torch_image: str) -> None:
    assert torch_image == torch_tag()
    r = docker("run", "--rm", "--network", "host", torch_image, "python", "-c",
               "import torch, numpy; print(torch.__version__, numpy.__version__, "
               "torch.ones(2).sum().item())", timeout=300)
    words = r.stdout.split()
    assert words[0].startswith("2.") and words[-1] == "2.0", r.stdout


def _manifest_digest(reg: Registry, repo: str, tag: str) -> str:
    req = urllib.request.Request(
        f"http://{reg.host}/v2/{repo}/manifests/{tag}", method="HEAD",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    import base64
    token = base64.b64encode(f"{reg.username}:{reg.password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        return str(resp.headers["Docker-Content-Digest"])


def test_registry_refuses_anonymous_pulls_and_serves_the_pushed_digest(
        registry: Registry, tiny_image: str, tmp_path: Path) -> None:
    ref, digest = registry.push(tiny_image, "kit/tiny:v1")
    assert ref == f"{registry.host}/kit/tiny:v1"
    assert digest == _manifest_digest(registry, "kit/tiny", "v1")
    anon = docker("--config", str(tmp_path / "anon"), "pull", ref, check=False)
    assert anon.returncode != 0 and "no basic auth credentials" in anon.stderr, anon.stderr
    cfg = tmp_path / "login"
    registry.login(cfg)
    # docker keeps base64(user:password) there, never the password as typed
    assert registry.password not in (cfg / "config.json").read_text()
    docker("pull", ref, config=cfg)
    repo_digests = json.loads(docker("image", "inspect", "--format", "{{json .RepoDigests}}",
                                     ref).stdout)
    assert f"{registry.host}/kit/tiny@{digest}" in repo_digests
    assert ref in registry.local_refs()
    # the push kept no tag of its own and left no login behind
    assert not list(registry.scratch.glob("login-*"))


def test_registry_ends_with_its_pulled_images_untagged_and_its_port_closed(
        docker_engine: str, tiny_image: str, tmp_path: Path) -> None:
    with run_registry(tmp_path / "reg") as reg:
        ref, _ = reg.push(tiny_image, "gone/tiny")
        cfg = tmp_path / "cfg"
        reg.login(cfg)
        docker("pull", ref, config=cfg)
        assert reg.local_refs() == [ref]
    assert reg.local_refs() == []
    assert docker("image", "inspect", tiny_image, check=False).returncode == 0
    with pytest.raises(OSError):
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://{reg.host}/v2/", timeout=2)


def test_a_build_lock_makes_the_other_process_wait(tmp_path: Path) -> None:
    name = f"selftest-{os.getpid()}"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from dockerkit import machine_lock
        with machine_lock({name!r}):
            print(time.monotonic(), flush=True)
    """)
    with machine_lock(name):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        assert child.poll() is None          # still waiting for the lock
        released = time.monotonic()
    out, _ = child.communicate(timeout=30)
    assert float(out) >= released


def test_no_engine_skips_with_a_reason_the_strict_run_refuses(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from dockerkit import docker_engine  # noqa: F401\nfrom skipcheck import register\n\n\n"
        "def pytest_configure(config):\n    register(config)\n")
    (tmp_path / "test_d.py").write_text("def test_d(docker_engine):\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "CLOUDTRAIN_STRICT_SKIPS": "1",
           "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", "-rs", str(tmp_path)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert "1 skipped" in r.stdout and "needs a Docker Engine" in r.stdout, r.stdout
    assert "bash scripts/dockerd.sh" in r.stdout
    assert r.returncode == 1 and "skipped for a wrong reason" in r.stdout, r.stdout
    env["CLOUDTRAIN_STRICT_SKIPS"] = "0"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", str(tmp_path)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout
