"""scripts/setup.sh as a newcomer meets it: one line when all is well, pip's chatter (this
machine's pip config alone prints ~130 warnings) in .venv/setup.log, and on a failure the
log's last lines and its path; a second run installs nothing.

The script runs on a copy of its folder with a stub ``.venv/bin/python`` that plays pip (its
warnings, then success or a failure), and stubs for the system commands it looks for, so no
package is installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

WARNINGS = 130
STUB_PYTHON = f"""#!/usr/bin/env bash
echo "$*" >>"$STUB_CALLS"
case "$1" in
  -c) if [[ "$2" == *"print("* ]]; then echo "cloudtrain 0.1.0 torch 2.13.0+cpu"; exit 0; fi
      [ -e "$STUB_INSTALLED" ]; exit $? ;;
  -m) for i in $(seq {WARNINGS}); do echo "WARNING: Location '/opt/x$i' is ignored"; done
      if [[ "$*" == *" -e "* ]]; then
          if [ -n "${{STUB_PIP_FAIL:-}}" ]; then
              echo "ERROR: No matching distribution found for torch==2.13.0" >&2; exit 1
          fi
          touch "$STUB_INSTALLED"
      fi
      exit 0 ;;
esac
exit 3
"""
SYSTEM = ("sshd", "ssh", "rsync", "shellcheck", "ip", "pgrep", "rclone")


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A checkout's shape: scripts/setup.sh, pyproject.toml, constraints-dev.txt and a .venv
    whose python is the stub; the system commands setup.sh looks for are stubs too."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    for name in ("pyproject.toml", "constraints-dev.txt"):
        shutil.copy(REPO / name, root / name)
    (root / ".venv" / "bin").mkdir(parents=True)
    _exe(root / ".venv" / "bin" / "python", STUB_PYTHON)
    sysbin = tmp_path / "sysbin"
    sysbin.mkdir()
    for name in SYSTEM:
        _exe(sysbin / name, "#!/bin/sh\nexit 0\n")
    return root


def _run(tree: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    tmp = tree.parent
    env = {k: v for k, v in os.environ.items() if k != "CLOUDTRAIN_TORCH_INDEX"}
    env.update({"PATH": f"{tmp / 'sysbin'}:{os.environ['PATH']}", "TMPDIR": str(tmp),
                "STUB_CALLS": str(tmp / "calls"), "STUB_INSTALLED": str(tmp / "installed"),
                **extra})
    return subprocess.run(["bash", str(tree / "scripts" / "setup.sh")], capture_output=True,
                          text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)


def _pip_calls(tree: Path) -> list[str]:
    calls = tree.parent / "calls"
    return [c for c in calls.read_text().splitlines() if c.startswith("-m pip")] \
        if calls.exists() else []


def test_an_install_prints_one_line_and_keeps_pips_output_in_the_log(tree: Path) -> None:
    r = _run(tree)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["setup: ready (cloudtrain 0.1.0 torch 2.13.0+cpu)"]
    assert r.stderr == ""
    log = (tree / ".venv" / "setup.log").read_text()
    assert log.count("WARNING: Location") == 2 * WARNINGS   # pip upgrade + the install
    assert "-c constraints-dev.txt torch numpy -e .[dev]" in log
    assert len(_pip_calls(tree)) == 2

    # Again: everything is there, nothing is installed, the log of the install stays.
    r = _run(tree)
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "setup: ready (cloudtrain 0.1.0 torch 2.13.0+cpu)"], r.stdout + r.stderr
    assert len(_pip_calls(tree)) == 2
    assert (tree / ".venv" / "setup.log").read_text() == log


def test_a_failing_pip_shows_the_logs_tail_and_its_path(tree: Path) -> None:
    r = _run(tree, STUB_PIP_FAIL="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout == ""
    err = r.stderr.splitlines()
    assert err[0] == "setup: pip install failed (exit 1); the last 40 lines of its output:", err
    assert err[-1] == "setup: the whole log: .venv/setup.log", err
    tail = err[1:-1]
    assert len(tail) == 40 and all(line.startswith("  | ") for line in tail), tail
    assert tail[-1] == "  | ERROR: No matching distribution found for torch==2.13.0"
    log = (tree / ".venv" / "setup.log").read_text()
    assert log.count("WARNING: Location") == 2 * WARNINGS
    assert not (tree / ".venv" / ".installed").exists()   # the next run tries again


def test_a_torch_index_installs_torch_from_it_first(tree: Path) -> None:
    url = "https://download.pytorch.org/whl/cpu"
    r = _run(tree, CLOUDTRAIN_TORCH_INDEX=url)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stdout + r.stderr
    calls = _pip_calls(tree)
    assert len(calls) == 3, calls
    assert f"--index-url {url} torch" in calls[1] and "-c constraints-dev.txt" in calls[1]
    assert "-e .[dev]" in calls[2]


def test_a_missing_python_is_reported_with_its_log(tree: Path) -> None:
    shutil.rmtree(tree / ".venv")
    r = _run(tree, PYTHON=str(tree.parent / "sysbin" / "no-such-python"))
    assert r.returncode != 0 and r.stdout == "", r.stdout + r.stderr
    assert "setup: creating .venv with " in r.stderr and " failed (exit " in r.stderr, r.stderr
    kept = tree.parent / "cloudtrain-setup.log"   # no .venv yet: next to the temporary log
    assert f"setup: the whole log: {kept}" in r.stderr, r.stderr
    assert "no-such-python" in kept.read_text()
    assert "Traceback" not in r.stderr
