"""The README's test command lists every skip with its reason and fails on a false one (a
"not installed" for what is installed, a "needs root" run as root): the six host-key tests
once never ran from it, skipped as "SDK not installed" while the SDKs were there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _suite(tmp_path: Path, body: str, strict: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(
        "from skipcheck import register\n\n\ndef pytest_configure(config):\n"
        "    register(config)\n")
    (tmp_path / "test_some.py").write_text("import os\nimport pytest\n\n\n" + body)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"),
           "CLOUDTRAIN_STRICT_SKIPS": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


FALSE_SKIP = ('def test_uses_the_sdk():\n    pytest.skip("boto3 not installed")\n\n\n'
              'def test_runs():\n    pass\n')


def test_a_false_skip_fails_the_strict_run_and_names_the_test(tmp_path: Path) -> None:
    r = _suite(tmp_path, FALSE_SKIP, strict=True)
    assert r.returncode == 1, r.stdout
    assert "1 skipped" in r.stdout and "boto3 not installed" in r.stdout
    assert "skipped for a wrong reason" in r.stdout
    assert "test_some.py::test_uses_the_sdk: 'boto3 not installed'" in r.stdout


def test_without_strict_mode_the_skips_are_listed_and_the_run_passes(tmp_path: Path) -> None:
    r = _suite(tmp_path, FALSE_SKIP, strict=False)
    assert r.returncode == 0, r.stdout
    assert "1 skipped" in r.stdout and "boto3 not installed" in r.stdout
    assert "wrong reason" not in r.stdout


def test_a_true_skip_passes_the_strict_run(tmp_path: Path) -> None:
    # Whether this machine has a GPU or not, the skip below says what is true here.
    body = ('HAS = __import__("shutil").which("nvidia-smi") is not None\n\n\n'
            '@pytest.mark.skipif(not HAS, reason="needs an NVIDIA GPU")\n'
            'def test_gpu():\n    pass\n')
    r = _suite(tmp_path, body, strict=True)
    assert r.returncode == 0, r.stdout
