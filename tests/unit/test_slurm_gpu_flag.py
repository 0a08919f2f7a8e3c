"""resources.slurm.gpu_flag without a Slurm cluster: a bad value exits 2 naming the field
(through the real CLI), and ``auto`` submits once more with --gpus-per-node when the login
node's sbatch refuses --gres (a login node whose sbatch is a script here that refuses it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import CLI

from cloudtrain.errors import UserError
from cloudtrain_provisioners.slurm import sched
from cloudtrain_provisioners.slurm.login import Login

TASK = """name: lab
num_nodes: 2
resources:
  provider: slurm
  accelerators: H100:2
  slurm:
    gpu_flag: {flag}
run: echo hi
"""


def test_bad_gpu_flag_exits_2(cli: CLI, tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(TASK.format(flag="gpus"))
    r = cli.run("up", str(f), "--dry-run")
    assert r.returncode == 2 and "resources.slurm.gpu_flag" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def sbatch_refusing_gres(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An sbatch first in PATH that refuses --gres (as a site's submit rules may) and takes
    --gpus-per-node, logging each call."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls"
    (bin_ / "sbatch").write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in *--gres=*) echo "sbatch: error: use --gpus-per-node at this site" >&2; exit 1;; esac
echo 42
""")
    (bin_ / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    return log


def test_auto_falls_back_to_gpus_per_node(sbatch_refusing_gres: Path) -> None:
    args = ["-N", "2", *sched.gpu_args("auto", None, 2)]
    assert args[-1] == "--gres=gpu:2"
    assert sched.submit_gpus(Login(), args, "auto", "#!/bin/sh\n") == ("42", "gpus-per-node")
    assert sbatch_refusing_gres.read_text().splitlines() == [
        "--parsable -N 2 --gres=gpu:2", "--parsable -N 2 --gpus-per-node=2"]


def test_gres_asked_is_not_swapped(sbatch_refusing_gres: Path) -> None:
    with pytest.raises(UserError, match="use --gpus-per-node at this site"):
        sched.submit_gpus(Login(), ["--gres=gpu:h100:2"], "gres", "#!/bin/sh\n")
    assert len(sbatch_refusing_gres.read_text().splitlines()) == 1
