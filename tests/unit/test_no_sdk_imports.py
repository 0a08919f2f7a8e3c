"""``cloudtrain --help`` and ``status`` must not import a cloud SDK (slow, and maybe absent), and
``--help`` must not even import paramiko: startup stays fast."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SDK_ROOTS = ("boto3", "botocore", "google", "azure")

SNIPPET = r"""
import json, sys
import cloudtrain.commands.main

results = {}
for name, args in (("help", ["--help"]), ("status", ["status"])):
    try:
        cloudtrain.commands.main.cli.main(args=args, prog_name="cloudtrain", standalone_mode=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    results[name] = {"code": code, "modules": sorted(sys.modules)}
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"})
    return env


def _sdk_modules(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in SDK_ROOTS]


def test_help_and_status_import_no_cloud_sdk(tmp_path: Path) -> None:
    out_file = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", SNIPPET, str(out_file)], capture_output=True,
                       text=True, timeout=60, env=_env(tmp_path / "home"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    results = json.loads(out_file.read_text())

    help_, status = results["help"], results["status"]
    assert help_["code"] == 0, r.stdout + r.stderr
    assert status["code"] == 0, r.stdout + r.stderr
    assert "Usage: cloudtrain" in r.stdout
    assert "No clusters." in r.stdout
    # Sanity: the probe sees the modules each command really loaded.
    assert "click" in help_["modules"] and "cloudtrain.commands.main" in help_["modules"]
    assert "cloudtrain.cluster" not in help_["modules"]
    assert "cloudtrain.cluster" in status["modules"] and "cloudtrain.state" in status["modules"]

    assert _sdk_modules(help_["modules"]) == []
    assert _sdk_modules(status["modules"]) == []
    assert not [m for m in help_["modules"] if m.split(".")[0] == "paramiko"]
    # The heavy libraries --help has no use for stay out too.
    assert "pydantic" not in help_["modules"]
    assert "rich" not in help_["modules"]


def test_python_dash_m_help_lists_the_commands(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "cloudtrain", "--help"], capture_output=True,
                       text=True, timeout=60, env=_env(tmp_path / "home"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    section = r.stdout.split("Commands:", 1)
    assert len(section) == 2, r.stdout
    listed = set(re.findall(r"^\s{2}(\w[\w-]*)\s", section[1], flags=re.M))
    assert {"up", "launch", "exec", "logs", "ssh", "status", "down"} <= listed, listed
    # --help alone creates no state.
    assert not (tmp_path / "home").exists()
