"""Command-line overrides (``--gpus``, ``--num-nodes``, ``--use-spot``, ``--provider``,
``--region``), ``launch --dry-run`` and ``launch [TASK] -- CMD``, through the real command
line: what the plan shows, what is refused (exit 2, naming the flag, nothing created), and that
a dry run creates nothing and starts no node."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from conftest import CLI, processes_with

TASK = """\
name: ov-demo
num_nodes: 2
resources:
  provider: local
  local:
    price_per_hour: 1.5
workdir: .
run: echo from-the-file
"""


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    d.mkdir()
    (d / "task.yaml").write_text(TASK)
    return d


def nothing_created(cli: CLI) -> None:
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())
    assert cli.status() == []
    assert processes_with(str(cli.home)) == []


def test_up_dry_run_shows_each_override_over_the_file(cli: CLI, proj: Path) -> None:
    r = cli.run("up", "task.yaml", "--dry-run", "--num-nodes", "3", "--no-use-spot", cwd=proj)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "nodes        3" in out
    assert "$4.50/h for the cluster" in out          # 3 x 1.5: the plan priced 3 nodes
    assert "num_nodes = 3 (--num-nodes, was 2)" in out
    assert "resources.use_spot = false (--no-use-spot)" in out
    assert (proj / "task.yaml").read_text() == TASK   # the file is not touched
    nothing_created(cli)


@pytest.mark.parametrize("args, flag, words", [
    (["--num-nodes", "0"], "--num-nodes '0'", "greater than or equal to 1"),
    (["--gpus", "A100:x"], "--gpus 'A100:x'", "not a whole number"),
    (["--gpus", "A100:0"], "--gpus 'A100:0'", "greater than or equal to 1"),
    (["--provider", "nope"], "--provider 'nope'", "Unknown provider 'nope'"),
    (["--region", "us east"], "--region 'us east'", "is not a region or zone name"),
])
def test_a_bad_override_is_refused_naming_its_flag(cli: CLI, proj: Path, args: list[str],
                                                   flag: str, words: str) -> None:
    for command in (["up", "task.yaml", "--dry-run"], ["launch", "task.yaml", "-y"],
                    ["cost", "task.yaml"]):
        r = cli.run(*command, *args, cwd=proj)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert r.stderr.startswith(f"error: {flag}: "), r.stderr
        assert words in r.stderr
        assert "Traceback" not in r.stderr
        assert "task.yaml" not in r.stderr.splitlines()[0]   # the flag's fault, not the file's
    nothing_created(cli)


def test_the_file_is_still_checked_with_the_overrides_in(cli: CLI, proj: Path) -> None:
    r = cli.run("up", "task.yaml", "--dry-run", "--gpus", "A100:8", cwd=proj)
    assert r.returncode == 2
    assert "local nodes have no GPUs" in r.stderr
    nothing_created(cli)


def test_launch_dry_run_shows_the_plan_the_command_and_the_budget(cli: CLI, proj: Path) -> None:
    r = cli.run("launch", "task.yaml", "--dry-run", "--env", "LR=0.1", "--max-cost", "100",
                "--hours", "2", "--", "python", "-c", "print('a b')", cwd=proj)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Plan for cluster 'ov-demo' (dry run: nothing is created)" in out
    assert "'ov-demo' would be created" in out
    run_line = shlex.join(["python", "-c", "print('a b')"])
    assert f"    {run_line}" in out                       # CMD, quoted for the shell
    assert "from-the-file" not in out.split("would run:")[1]   # CMD replaced the task's run:
    assert "(-- CMD, was echo from-the-file)" in out
    assert "on nodes     2 node(s)" in out
    assert "env          LR (values not shown)" in out and "0.1" not in out
    assert "Estimate for 2 h: $6.0000 of the $100.0000 budget." in out
    nothing_created(cli)


def test_launch_dry_run_refuses_what_launch_would_refuse_for_the_budget(cli: CLI,
                                                                        proj: Path) -> None:
    r = cli.run("launch", "task.yaml", "--dry-run", "--max-cost", "1", "--hours", "2",
                "--num-nodes", "4", cwd=proj)
    assert r.returncode == 2
    assert "The estimate for 2 h (--hours) is $12.0000: 4 node(s)" in r.stderr
    nothing_created(cli)


def test_launch_without_a_task_makes_one_from_the_flags(cli: CLI, tmp_path: Path) -> None:
    work = tmp_path / "My_Project.v2"
    work.mkdir()
    r = cli.run("launch", "--dry-run", "--num-nodes", "2", "--", "echo", "x;y", cwd=work)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Plan for cluster 'my-project-v2'" in out       # from the workdir, made safe
    assert "run = echo 'x;y' (-- CMD)" in out
    assert "nodes        2" in out
    r = cli.run("launch", "--dry-run", "-c", "other", "--workdir", str(work), "--", "true",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Plan for cluster 'other'" in r.stdout + r.stderr
    nothing_created(cli)


def test_launch_needs_a_task_or_a_command(cli: CLI, tmp_path: Path) -> None:
    r = cli.run("launch", "-y", cwd=tmp_path)
    assert r.returncode == 2
    assert "Usage: cloudtrain launch [OPTIONS] [TASK_FILE] [-- CMD...]" in r.stderr
    assert "launch needs a task file, or a command after '--'" in r.stderr
    r = cli.run("launch", "-y", "--", cwd=tmp_path)
    assert r.returncode == 2 and "Nothing follows '--'" in r.stderr
    r = cli.run("launch", "task.yaml", "--workdir", ".", "--", "true", cwd=tmp_path)
    assert r.returncode == 2 and "--workdir goes with a launch without a task file" in r.stderr
    nothing_created(cli)


def test_cost_prices_the_overridden_task(cli: CLI, proj: Path) -> None:
    (proj / "gpu.yaml").write_text("name: g\nresources:\n  accelerators: A100:8\nrun: x\n")
    r = cli.run("cost", "gpu.yaml", "--json", "--provider", "aws", "--num-nodes", "2",
                "--gpus", "A100:8", "--use-spot", cwd=proj)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["num_nodes"] == 2
    assert doc["choice"]["provider"] == "aws" and doc["choice"]["market"] == "spot"
    assert {o["provider"] for o in doc["offers"]} == {"aws"}
    assert {(o["flag"], o["value"], o["task_file_value"]) for o in doc["overrides"]} == {
        ("--provider", "aws", None), ("--num-nodes", 2, None), ("--gpus", "A100:8", "A100:8"),
        ("--use-spot", True, None)}
    r = cli.run("cost", "task.yaml", "--json", "--num-nodes", "3", cwd=proj)   # local: no catalog
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["choice"]["cluster_hourly_usd"] == 4.5
    assert doc["overrides"] == [{"flag": "--num-nodes", "field": "num_nodes", "value": 3,
                                 "task_file_value": 2}]
    r = cli.run("cost", "gpu.yaml", "--gpus", "A100:8", "--accelerators", "A100:8", cwd=proj)
    assert r.returncode == 2 and "--gpus and --accelerators both set the GPUs" in r.stderr


def test_a_background_recovery_controller_would_lose_the_overrides(cli: CLI, proj: Path) -> None:
    r = cli.run("launch", "task.yaml", "-y", "-d", "--recover", "--num-nodes", "1", cwd=proj)
    assert r.returncode == 2
    assert "-d with recovery runs a controller that reads the task file again" in r.stderr
    nothing_created(cli)
