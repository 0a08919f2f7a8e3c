"""A core-only install of cloudtrain, as a user gets it from a wheel: ``python -m build
--wheel`` of this checkout, a fresh ``python -m venv`` (no system site-packages: the dev
venv's cloud SDKs must not be seen), and ``pip install`` of the wheel without extras, its
core dependencies from the package index pip is configured with.

Made once per pytest process (per xdist run: once, under a lock) and shared by every test
module that imports the fixture::

    from corevenv import core_venv   # noqa: F401  (the fixture: the venv's bin/ directory)

About 16 s on an idle 2-core machine (build ~5 s, venv ~4 s, pip install ~8 s), 35-55 s while
other tests load it; ``BUILD_SECONDS`` records the steps, and ``ready`` in its folder keeps them.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SDK_MODULES = ("boto3", "botocore", "google", "azure")   # google.*, azure.*: namespaces
BUILD_SECONDS: dict[str, float] = {}   # step -> seconds, when this process built the venv


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for the core venv's processes: nothing from this checkout or the
    test session (PYTHONPATH, CLOUDTRAIN_*, cloud credentials), pip quiet about itself."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CLOUDTRAIN_", "AWS_", "AZURE_", "GOOGLE_", "CLOUDSDK_"))
           and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update({"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "NO_COLOR": "1"})
    env.update(extra)
    return env


def _step(name: str, cmd: list[str], log: Path, cwd: Path, timeout: float) -> None:
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=clean_env(),
                           timeout=timeout)
    BUILD_SECONDS[name] = round(time.monotonic() - t0, 1)
    if r.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"core venv: {name} failed (exit {r.returncode}); log {log}:\n{tail}",
                    pytrace=False)


def build_wheel(out: Path, log: Path) -> Path:
    """``python -m build --wheel`` of this checkout into ``out``: the README's line, with the
    build backend (hatchling) fetched into an isolated build environment."""
    _step("build", [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)],
          log, out, 300)
    wheels = sorted(out.glob("cloudtrain-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}: {wheels}"
    return wheels[0]


def make_core_venv(root: Path) -> Path:
    """Build the wheel and a venv at ``root/venv`` with it installed (no extras); return its
    bin/ directory. A finished venv (``root/ready``) is reused."""
    venv, ready, log = root / "venv", root / "ready", root / "build.log"
    if ready.exists():
        return venv / "bin"
    (root / "dist").mkdir(parents=True, exist_ok=True)
    built = sorted((root / "dist").glob("cloudtrain-*.whl"))
    wheel = built[0] if built else build_wheel(root / "dist", log)
    _step("venv", [sys.executable, "-m", "venv", "--clear", str(venv)], log, root, 300)
    _step("install", [str(venv / "bin" / "python"), "-m", "pip", "install", str(wheel)],
          log, root, 600)
    probe = ("import importlib.util as u\n"
             "def found(m):\n"
             "    try:\n"
             "        return u.find_spec(m) is not None\n"
             "    except ModuleNotFoundError:\n"
             "        return False\n"
             f"print([m for m in {SDK_MODULES!r} if found(m)])")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True,
                       text=True, cwd=root, env=clean_env(), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", \
        f"the core venv has a cloud SDK (or python failed): {r.stdout}{r.stderr}"
    ready.write_text(f"{BUILD_SECONDS}\n")
    return venv / "bin"


def _shared_root(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    # Under pytest-xdist every worker's basetemp is a child of the run's: build once for all.
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "core-venv"


@pytest.fixture(scope="session")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ directory of a venv holding cloudtrain's wheel and its core dependencies
    only: ``core_venv / "cloudtrain"`` is the user's command, ``core_venv / "python"`` its
    interpreter. No cloud SDK is importable there."""
    root = _shared_root(tmp_path_factory)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "core-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another module's fixture or xdist worker
        return make_core_venv(root)
