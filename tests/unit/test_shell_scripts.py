from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "bootstrap").glob("*.sh")) + sorted((REPO / "scripts").glob("*.sh")) \
    + [REPO / ".ci" / "run"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script: Path) -> None:
    r = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ctkill_stops_a_process_that_left_the_job_group(tmp_path: Path) -> None:
    """A worker in its own session escapes a process-group kill; the marker still finds it."""
    env = {"PATH": "/usr/bin:/bin", "CLOUDTRAIN_JOB_ID": f"t-{tmp_path.name}"}
    p = subprocess.Popen(["setsid", "sleep", "300"], env=env)
    try:
        r = subprocess.run(["bash", str(REPO / "bootstrap" / "ctkill.sh"), "",
                            f"CLOUDTRAIN_JOB_ID=t-{tmp_path.name}", "2"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0
        assert "::left 0" in r.stdout
        assert p.wait(timeout=5) != 0
    finally:
        if p.poll() is None:
            p.kill()
