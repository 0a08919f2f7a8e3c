"""Bootstrap on Slurm through the real CLI against the test cluster: one check step inside the
allocation finds the Python with PyTorch and what it sees on every node, once per allocation
(a warm launch skips it); a CUDA build of PyTorch seeing fewer GPUs than Slurm allocated is an
error naming the node; and a job that needs PyTorch where there is none gets a venv built on
the shared filesystem from the login node.

The venv is built for real (``python3 -m venv`` and ``pip install``), but from a wheel index on
loopback that serves a tiny stand-in package named ``torch`` (the real wheel's dependencies
need PyPI, and tests talk only to loopback); the test fake GPUs are character devices, so
PyTorch here is a CPU build and its GPU count is checked with a stand-in CUDA build."""

from __future__ import annotations

import functools
import http.server
import shutil
import sys
import threading
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

from conftest import CLI
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
pytestmark = [needs_slurm, pytest.mark.e2e]


RUN = "run: python -c 'import torch; print(\"torch\", torch.__version__)'"


def task(tmp_path: Path, name: str, slurm_extra: str = "", rest: str = "") -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"""name: {name}
num_nodes: 2
max_hours: 0.25
resources:
  provider: slurm
  accelerators: H100:2
  slurm:
    workdir: {tmp_path / 'shared' / name}{slurm_extra}
{rest or RUN}
""")
    return f


def fake_torch(root: Path, version: str, cuda: str | None, gpus: int) -> Path:
    """A package named torch that says it is ``version`` and sees ``gpus`` GPUs."""
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        f"__version__ = {version!r}\nfrom torch import version, cuda\n")
    (pkg / "version.py").write_text(f"cuda = {cuda!r}\n")
    (pkg / "cuda.py").write_text(f"def device_count():\n    return {gpus}\n")
    return root


def test_found_torch_checked_once_per_allocation(slurm: SlurmCluster, cli: CLI,
                                                 tmp_path: Path) -> None:
    f = task(tmp_path, "boot", f"\n    python: {sys.executable}")
    first = cli.run("launch", str(f), "-y")
    assert first.returncode == 0, first.stderr
    assert "Bootstrap: checking the Python and PyTorch on 2 node(s)" in first.stderr
    import torch
    for rank in (0, 1):
        assert f"node {rank}: {sys.executable}: PyTorch {torch.__version__} (a CPU build)" \
            in first.stderr, first.stderr
    assert sorted(ln for ln in first.stdout.splitlines() if "torch" in ln) == [
        f"(node-0) torch {torch.__version__}", f"(node-1) torch {torch.__version__}"]
    warm = cli.run("launch", str(f))
    assert warm.returncode == 0, warm.stderr
    assert "Bootstrap" not in warm.stderr         # the same allocation: nothing asked again
    # The probe's step is no job (the guard, queue and cancel count ct-job-* steps).
    (alloc,) = [j["id"] for j in slurm.jobs()]
    names = slurm.run("sacct", "-n", "-P", "-j", alloc, "-o", "JobName").stdout.split()
    assert f"ct-bootstrap-{alloc}" in names, names
    assert len([n for n in names if n.startswith("ct-job-")]) == 2, names   # the two launches
    assert cli.run("down", "boot", "-y").returncode == 0


def test_gpu_count_differing_names_the_node(slurm: SlurmCluster, cli: CLI,
                                            tmp_path: Path) -> None:
    lib = fake_torch(tmp_path / "lib", "9.9.0", "12.4", gpus=1)
    py = tmp_path / "bin" / "python"
    py.parent.mkdir()
    py.write_text(f"#!/bin/sh\nPYTHONPATH={lib} exec {SYSTEM_PYTHON} \"$@\"\n")
    py.chmod(0o755)
    r = cli.run("launch", str(task(tmp_path, "gpus", f"\n    python: {py}")), "-y")
    assert r.returncode == 1, r.stderr
    assert "node 0 (n1): PyTorch 9.9.0 sees 1 GPU(s), Slurm allocated 2." in r.stderr
    assert "torch" not in r.stdout                # the job did not run
    assert cli.run("down", "gpus", "-y").returncode == 0


@pytest.fixture
def wheel_index(tmp_path: Path) -> Iterator[str]:
    """A PEP 503 index on loopback serving torch 0.0.1 (a stand-in, see the module's doc)."""
    src = fake_torch(tmp_path / "wheelsrc", "0.0.1", None, gpus=0)
    simple = tmp_path / "index" / "torch"
    simple.mkdir(parents=True)
    whl = simple / "torch-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p in sorted((src / "torch").iterdir()):
            z.write(p, f"torch/{p.name}")
        info = "torch-0.0.1.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 0.0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                    "true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    (simple / "index.html").write_text(f'<a href="{whl.name}">{whl.name}</a>\n')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


def test_venv_built_when_the_job_needs_torch(slurm: SlurmCluster, cli: CLI, tmp_path: Path,
                                             wheel_index: str) -> None:
    bare = SYSTEM_PYTHON                      # Debian's python3: no torch
    f = task(tmp_path, "venv", f"\n    python: {bare}",
             f"bootstrap:\n  torch: torch==0.0.1\n  torch_index: {wheel_index}\n"
             'run: echo "py=$(command -v python) $(python -c \'import torch; '
             'print(torch.__version__)\')"')
    r = cli.run("launch", str(f), "-y", timeout=400)
    assert r.returncode == 0, r.stderr
    venv = tmp_path / "shared" / "venv" / ".cloudtrain" / "venv"
    assert f"building a venv at {venv} with torch==0.0.1" in r.stderr
    assert f"node 1: {venv}/bin/python: PyTorch 0.0.1 (a CPU build)" in r.stderr
    assert sorted(ln for ln in r.stdout.splitlines() if "py=" in ln) == [
        f"(node-0) py={venv}/bin/python 0.0.1", f"(node-1) py={venv}/bin/python 0.0.1"]
    assert cli.run("down", "venv", "-y").returncode == 0
