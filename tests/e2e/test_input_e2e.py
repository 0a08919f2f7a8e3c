"""Task input as the user meets it on real local nodes (sshd on loopback): the script's
`train.args` reach it untouched through torchrun (finding 18), a file_mounts target that
climbs out of the node's workdir is refused before anything exists, leaving nothing where it
pointed (finding 16), and a bootstrap.python the node lacks is named by bootstrap instead of
starting a PyTorch install (issue 21)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, needs_torch

pytestmark = [needs_sshd, pytest.mark.e2e]

ARGS = ["--n", "3", "--max", "2", "--nnodes", "9", "--rdzv", "x y", "it's"]


@needs_torch
def test_train_args_that_abbreviate_torchrun_options_reach_the_script(cli: CLI,
                                                                      tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(
        "import json, os, sys\n"
        "print('ARGV=' + json.dumps(sys.argv[1:]) + ' RANK=' + os.environ['RANK'])\n")
    task = proj / "task.yaml"
    task.write_text("name: args\nnum_nodes: 1\nworkdir: .\nenvs: {OMP_NUM_THREADS: '1'}\n"
                    "train:\n  script: train.py\n  nproc_per_node: 1\n"
                    f"  args: {json.dumps(ARGS)}\n")
    r = cli.run("launch", str(task), "--down", "-y", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ambiguous option" not in r.stdout + r.stderr
    got = [ln.split("ARGV=", 1)[1] for ln in r.stdout.splitlines() if "ARGV=" in ln]
    assert got, r.stdout[-3000:]
    assert json.loads(got[0].rsplit(" RANK=", 1)[0]) == ARGS
    assert_nothing_left(cli.home)


def test_mount_target_climbing_out_of_the_node_is_refused_and_writes_nothing(
        cli: CLI, tmp_path: Path) -> None:
    # From a local node's workdir (HOME/clusters/NAME/local/nodes/0/workdir), seven '..' reach
    # the test's own directory: on the old code the mount was written there, on this machine.
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "x.txt").write_text("x\n")
    escaped = tmp_path / "escaped"
    task = proj / "task.yaml"
    task.write_text("name: esc\nnum_nodes: 1\nworkdir: .\nfile_mounts:\n"
                    f"  {'../' * 7}escaped: ./data\nrun: ls\n")
    r = cli.run("launch", str(task), "--down", "-y", timeout=400)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "field 'file_mounts'" in r.stderr and "'..'" in r.stderr, r.stderr
    assert not escaped.exists()
    assert cli.status() == []
    assert_nothing_left(cli.home)


def test_bootstrap_python_missing_on_the_node_is_named_not_replaced(cli: CLI,
                                                                    tmp_path: Path) -> None:
    """bootstrap.python names a Python the node does not have: bootstrap stops at its python
    step naming the field and the path, and installs nothing (no virtualenv, no PyTorch)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    missing = tmp_path / "no-such-env" / "bin" / "python"
    task = proj / "task.yaml"
    task.write_text(f"name: nopy\nnum_nodes: 1\nworkdir: .\nbootstrap:\n  python: {missing}\n"
                    "run: echo ran\n")
    r = cli.run("launch", str(task), "--down", "-y", timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert f"bootstrap.python: '{missing}' does not exist on this node" in out, out[-3000:]
    assert "step 'python' failed" in out, out[-3000:]
    assert "pip install" not in out and "virtualenv" not in out, out[-3000:]
    assert "ran" not in r.stdout.split()
    assert not missing.exists()
    r = cli.run("down", "nopy", "-y", timeout=120)
    assert_nothing_left(cli.home)
