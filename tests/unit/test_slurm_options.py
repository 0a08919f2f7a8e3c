"""resources.slurm checked before anything is asked of Slurm, through the real CLI: a bad
value exits 2 naming its field; the plan shows the allocation's sbatch line; a login node
without Slurm's commands exits 2 saying so. None of these need a Slurm cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CLI


def write(tmp_path: Path, slurm: str, extra: str = "") -> Path:
    f = tmp_path / "task.yaml"
    f.write_text(f"""name: lab
num_nodes: 2
max_hours: 1.5
resources:
  provider: slurm
  accelerators: H100:4{extra}
  slurm:
{slurm}
run: echo hi
""")
    return f


@pytest.mark.parametrize("slurm, field, words", [
    ("    partition: -p", "resources.slurm.partition", "not a Slurm name"),
    ("    account: 'a;b'", "resources.slurm.account", "not a Slurm name"),
    ("    login: '-oProxyCommand=x'", "resources.slurm.login", "login is 'local' or user@host"),
    ("    login: 'me@host:notaport'", "resources.slurm.login", ""),
    ("    modules: ['cuda/12.4; rm -rf ~']", "resources.slurm.modules", "not a module name"),
    ("    workdir: '/shared/my dir'", "resources.slurm.workdir", "not a plain path"),
    ("    price_per_gpu_hour: -1", "resources.slurm.price_per_gpu_hour", ""),
    ("    partiton: gpu", "resources.slurm.partiton", "Did you mean 'partition'?"),
])
def test_bad_option_exits_2_naming_the_field(cli: CLI, tmp_path: Path, slurm: str,
                                             field: str, words: str) -> None:
    r = cli.run("up", str(write(tmp_path, slurm)), "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert field in r.stderr and words in r.stderr
    assert "Traceback" not in r.stderr
    assert not (cli.home / "clusters" / "lab").exists()


def test_spot_is_refused(cli: CLI, tmp_path: Path) -> None:
    r = cli.run("up", str(write(tmp_path, "    partition: gpu", "\n  use_spot: true")),
                "--dry-run")
    assert r.returncode == 2 and "use_spot does not apply to the slurm provider" in r.stderr


def test_dry_run_shows_the_allocation(cli: CLI, tmp_path: Path) -> None:
    f = write(tmp_path, "    partition: gpu\n    account: lab\n    qos: high\n"
                        "    gpu_type: h100\n    price_per_gpu_hour: 1.5")
    r = cli.run("up", str(f), "--dry-run")
    assert r.returncode == 0, r.stderr
    line = " ".join((r.stdout + r.stderr).split())     # the plan wraps long lines
    for part in ("-J ct-lab", "-N 2", "--gres=gpu:h100:4", "-t 90", "-p gpu", "-A lab",
                 "-q high"):
        assert part in line, line
    assert "$6.00/h per node" in line               # 4 GPUs at $1.5 per GPU-hour


def test_login_node_without_sbatch(cli: CLI, tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    r = cli.run("up", str(write(tmp_path, "    login: local")), "-y", PATH=str(empty))
    assert r.returncode == 2, r.stderr
    assert "'squeue' is not installed on the login node (this machine)" in r.stderr
    assert "Traceback" not in r.stderr
    assert cli.run("status").stdout.strip() == "No clusters."
