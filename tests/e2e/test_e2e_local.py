"""End to end through the real CLI on the local provider: real sshd nodes, real rsync, real
torchrun, 2 nodes x 2 processes."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from conftest import (CLI, assert_nothing_left, ct_network_objects, needs_netns, needs_sshd,
                      needs_torch, processes_with, wait_until)

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]


def _task(d: Path, name: str, body: str) -> Path:
    p = d / f"{name}.yaml"
    p.write_text(body)
    return p


def _result(d: Path) -> dict[str, object]:
    return json.loads((d / "cloudtrain-outputs" / "outputs" / "result.json").read_text())


def _check_trained(d: Path) -> None:
    res = _result(d)
    # 2 nodes x 2 processes: 4 ranks, each checked sum(0..3) = 6 from the all-reduce
    assert res["world_size"] == 4
    assert res["allreduce_sum"] == 6.0
    assert res["num_nodes"] == 2
    assert res["replicas_in_sync"] is True
    assert res["last_loss"] < res["first_loss"]


def test_run_mode_launch_reuse_and_down(cli: CLI, demo_dir: Path) -> None:
    task = demo_dir / "run-task.yaml"
    r = cli.run("launch", str(task), "-y")
    assert r.returncode == 0, r.stderr + r.stdout
    _check_trained(demo_dir)
    for rank in range(4):
        assert f"rank {rank}/4" in r.stdout
    assert "(node-0)" in r.stdout and "(node-1)" in r.stdout
    before = cli.status()
    assert [c["name"] for c in before] == ["demo-run"]
    assert before[0]["status"] == "UP" and len(before[0]["nodes"]) == 2
    assert {n["status"] for n in before[0]["nodes"]} == {"running"}

    # The second launch reuses the warm cluster: no provisioning, same nodes.
    (demo_dir / "cloudtrain-outputs" / "outputs" / "result.json").unlink()
    r2 = cli.run("launch", str(task), "--down")
    assert r2.returncode == 0, r2.stderr
    assert "Provisioning" not in r2.stderr
    assert "Bootstrapping" not in r2.stderr and "Syncing" not in r2.stderr
    _check_trained(demo_dir)
    assert cli.status() == []
    assert_nothing_left(cli.home)


def test_train_static_on_loopback(cli: CLI, demo_dir: Path) -> None:
    r = cli.run("launch", str(demo_dir / "task.yaml"), "--down")
    assert r.returncode == 0, r.stderr + r.stdout
    _check_trained(demo_dir)
    assert cli.status() == []
    assert_nothing_left(cli.home)


@needs_netns
@pytest.mark.netns
@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_train_on_separate_network_stacks(cli: CLI, demo_dir: Path, rdzv: str) -> None:
    """Each node in its own network namespace behind a bridge, as on separate machines."""
    before = ct_network_objects()
    text = (demo_dir / "task.yaml").read_text()
    text = text.replace("provider: local", "provider: local\n  local: {network: netns}")
    text = text.replace("rendezvous: static", f"rendezvous: {rdzv}").replace("name: demo", f"name: ns-{rdzv}")
    task = _task(demo_dir, "ns", text)
    proc = cli.popen("launch", str(task), "--down")
    # While it runs, the namespaces and the bridge exist.
    assert wait_until(lambda: len(ct_network_objects() - before) >= 3, 60)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err + out
    _check_trained(demo_dir)
    # GLOO_SOCKET_IFNAME named the namespace's interface, not loopback
    log_dirs = list((cli.home / "logs" / f"ns-{rdzv}").iterdir())
    assert log_dirs
    assert ct_network_objects() - before == set()
    assert_nothing_left(cli.home)


def test_failure_of_one_rank_stops_all_and_tears_down(cli: CLI, demo_dir: Path) -> None:
    text = (demo_dir / "task.yaml").read_text().replace("name: demo", "name: fails")
    text += "envs:\n  FAIL_RANK: 3\n  FAIL_EXIT_CODE: 7\n  SLEEP_SECONDS: 300\n"
    task = _task(demo_dir, "fail", text)
    t0 = time.monotonic()
    r = cli.run("launch", str(task), "--down")
    took = time.monotonic() - t0
    assert r.returncode == 7, r.stderr + r.stdout
    assert "rank 3" in r.stderr and "node 1" in r.stderr
    assert "Traceback" not in r.stderr
    # The other ranks were sleeping 300 s: they were stopped, not waited for.
    assert took < 60
    assert cli.status() == []
    assert_nothing_left(cli.home)


def test_run_mode_failure_exit_code_names_node(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "rfail", """
name: rfail
num_nodes: 2
run: |
  if [ "$CLOUDTRAIN_NODE_RANK" = 1 ]; then sleep 0.5; echo boom; exit 9; fi
  sleep 300
""")
    t0 = time.monotonic()
    r = cli.run("launch", str(task))
    assert r.returncode == 9, r.stderr
    assert "node 1" in r.stderr
    assert time.monotonic() - t0 < 90
    # The cluster stays (no --down) but no process of the job is left on node 0.
    assert wait_until(lambda: not processes_with("CLOUDTRAIN_CLUSTER=rfail"), 10)
    assert [c["status"] for c in cli.status()] == ["UP"]
    logs = cli.run("logs", "rfail", "--node", "1")
    assert logs.returncode == 0
    assert "(node-1) boom" in logs.stdout
    assert "(node-0)" not in logs.stdout


@pytest.mark.parametrize("down", [True, False])
def test_ctrl_c_stops_job_everywhere(cli: CLI, tmp_path: Path, down: bool) -> None:
    task = _task(tmp_path, "sleepy", """
name: sleepy
num_nodes: 2
run: |
  echo "started on $CLOUDTRAIN_NODE_RANK"
  python -c "import time; time.sleep(600)" &
  setsid sleep 601 &   # escapes the job's process group: found by its environment marker
  sleep 600
""")
    args = ["launch", str(task)] + (["--down"] if down else [])
    proc = cli.popen(*args)
    marker = "CLOUDTRAIN_CLUSTER=sleepy"
    assert wait_until(lambda: len(processes_with(marker)) >= 6, 90), proc.stderr
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    gone = wait_until(lambda: not processes_with(marker), 10)
    assert gone, f"job processes still alive 10 s after Ctrl-C: {processes_with(marker)}"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 60
    if down:
        assert cli.status() == []
        assert_nothing_left(cli.home)
    else:
        assert [c["status"] for c in cli.status()] == ["UP"]


def test_setup_runs_once_per_content(cli: CLI, tmp_path: Path) -> None:
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "data.txt").write_text("v1\n")
    (proj / ".gitignore").write_text("ignored/\n")
    (proj / "ignored").mkdir()
    (proj / "ignored" / "big.bin").write_text("x")
    task = _task(proj, "setup", """
name: setupc
num_nodes: 2
workdir: .
setup: |
  echo setup-ran-$CLOUDTRAIN_NODE_RANK
run: |
  cat data.txt; test ! -e ignored/big.bin && echo no-ignored
""")
    r1 = cli.run("launch", str(task))
    assert r1.returncode == 0, r1.stderr
    assert r1.stdout.count("setup-ran-") == 2 and r1.stdout.count("v1") == 2
    assert r1.stdout.count("no-ignored") == 2
    r2 = cli.run("launch", str(task))
    assert r2.returncode == 0
    assert "setup-ran-" not in r2.stdout and "Syncing" not in r2.stderr
    (proj / "data.txt").write_text("v2\n")
    r3 = cli.run("launch", str(task))
    assert r3.returncode == 0
    assert r3.stdout.count("setup-ran-") == 2 and r3.stdout.count("v2") == 2


def test_exec_logs_and_detach(cli: CLI, tmp_path: Path) -> None:
    task = _task(tmp_path, "d", """
name: det
num_nodes: 2
run: |
  for i in 1 2 3; do echo "tick $i on $CLOUDTRAIN_NODE_RANK"; sleep 0.3; done
""")
    r = cli.run("launch", str(task), "-d")
    assert r.returncode == 0, r.stderr
    assert "started" in r.stderr
    f = cli.run("logs", "det", "--follow")
    assert f.returncode == 0, f.stderr
    assert "(node-0) tick 3 on 0" in f.stdout and "(node-1) tick 3 on 1" in f.stdout
    e = cli.run("exec", "det", "--", "echo", "rank=$CLOUDTRAIN_NODE_RANK", "n=$CLOUDTRAIN_NUM_NODES")
    assert e.returncode == 0, e.stderr
    assert "(node-0) rank=0 n=2" in e.stdout and "(node-1) rank=1 n=2" in e.stdout
    one = cli.run("exec", "det", "--node", "1", "--", "exit 4")
    assert one.returncode == 4
    bad = cli.run("exec", "det", "--node", "5", "--", "true")
    assert bad.returncode == 2 and "no node 5" in bad.stderr
    unknown = cli.run("logs", "nope")
    assert unknown.returncode == 2 and "nope" in unknown.stderr
    d = cli.run("down", "det", "-y")
    assert d.returncode == 0
    assert_nothing_left(cli.home)
    again = cli.run("down", "det", "-y")
    assert again.returncode == 2 and "No cluster named 'det'" in again.stderr


def test_file_mounts_and_outputs_from_every_node(cli: CLI, tmp_path: Path) -> None:
    proj = tmp_path / "p"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "x.txt").write_text("mounted\n")
    (tmp_path / "cfg.json").write_text("{}")
    task = _task(proj, "mounts", """
name: mounts
num_nodes: 2
workdir: .
file_mounts:
  inputs: ./data
  conf/cfg.json: ../cfg.json
outputs: [out/]
outputs_from: all
run: |
  mkdir -p out
  cat inputs/x.txt > out/from-$CLOUDTRAIN_NODE_RANK.txt
  test -f conf/cfg.json && echo cfg-ok
""")
    r = cli.run("launch", str(task), "--down")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("cfg-ok") == 2
    for rank in (0, 1):
        got = proj / "cloudtrain-outputs" / f"node-{rank}" / "out" / f"from-{rank}.txt"
        assert got.read_text() == "mounted\n"
    assert_nothing_left(cli.home)


def test_absolute_mount_on_local_nodes_is_refused_before_anything_exists(cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    task = _task(tmp_path, "abs", "name: absm\nnum_nodes: 1\nfile_mounts: {/data: ./d}\nrun: 'true'\n")
    r = cli.run("launch", str(task))
    assert r.returncode == 2
    assert "/data" in r.stderr and "relative" in r.stderr
    assert cli.status() == []
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())
