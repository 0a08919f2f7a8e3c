"""Stopping and cleaning up through the real CLI on the local provider: the grace a job gets to
write its checkpoint (stop_grace), SIGHUP handled like Ctrl-C, a launch rolling back the
cluster it created when bootstrap fails, live status of ssh clusters, and exec with the task's
environment."""

from __future__ import annotations

import json

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, needs_torch, processes_with, wait_until

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

# Node 0 traps SIGTERM and needs ~5 s to "write its checkpoint" (in its own process, as a
# training script does); node 1 fails once node 0 is ready, so the job is stopped everywhere
# (SIGTERM, then SIGKILL after stop_grace).
CHECKPOINTING = """
name: {name}
num_nodes: 2
{extra}
envs:
  READY: {ready}
outputs: [ckpt/]
run: |
  if [ "$CLOUDTRAIN_NODE_RANK" = 1 ]; then
    until [ -e "$READY" ]; do sleep 0.1; done
    exit 3
  fi
  exec python - <<'PY'
  import os, pathlib, signal, sys, time
  def stop(signum, frame):
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      print("checkpointing", flush=True)
      time.sleep(5)
      pathlib.Path("ckpt").mkdir(exist_ok=True)
      pathlib.Path("ckpt/run-" + os.environ["RUN"]).write_text("saved\\n")
      print("checkpoint-written", flush=True)
      sys.exit(143)
  signal.signal(signal.SIGTERM, stop)
  print("ready", flush=True)
  pathlib.Path(os.environ["READY"]).touch()
  time.sleep(600)
  PY
"""


# A Python without PyTorch and a wheel index nobody answers on: bootstrap fails.
BOOT_FAILS = """
name: bootfail
num_nodes: 2
resources:
  local: {python: /usr/bin/python3}
bootstrap:
  torch_index: http://127.0.0.1:9/simple
run: 'true'
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_stop_grace_lets_a_job_write_its_checkpoint_and_is_enforced(cli: CLI,
                                                                   tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    task = _write(tmp_path / "grace.yaml", CHECKPOINTING.format(name="grace", extra="",
                                                                ready=ready))
    # The default grace (60 s): the checkpoint is written, and pulled back with the outputs.
    t0 = time.monotonic()
    r = cli.run("launch", str(task), "--env", "RUN=1")
    took = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert "(node-0) checkpoint-written" in r.stdout, r.stdout
    assert "SIGKILL after 60 s" in r.stderr
    assert (tmp_path / "cloudtrain-outputs" / "ckpt" / "run-1").read_text() == "saved\n"
    assert took < 120
    # A short configured grace: SIGKILL comes before the 5 s checkpoint is done.
    ready.unlink()
    _write(task, CHECKPOINTING.format(name="grace", extra="stop_grace: 1", ready=ready))
    t0 = time.monotonic()
    r = cli.run("launch", str(task), "--env", "RUN=2")
    assert r.returncode == 3, r.stderr
    assert "SIGKILL after 1 s" in r.stderr
    assert "checkpointing" in r.stdout and "checkpoint-written" not in r.stdout
    assert not (tmp_path / "cloudtrain-outputs" / "ckpt" / "run-2").exists()
    assert wait_until(lambda: not processes_with("CLOUDTRAIN_CLUSTER=grace"), 10)
    assert cli.run("down", "grace", "-y").returncode == 0
    assert_nothing_left(cli.home)


@pytest.mark.parametrize("value", ["0", "-5", "3601", ".inf", ".nan", "soon"])
def test_stop_grace_must_be_a_sane_number_of_seconds(cli: CLI, tmp_path: Path, value: str) -> None:
    task = _write(tmp_path / "t.yaml", f"name: bad\nstop_grace: {value}\nrun: 'true'\n")
    r = cli.run("launch", str(task), "--down")
    assert r.returncode == 2, r.stderr
    assert "stop_grace" in r.stderr and "Traceback" not in r.stderr
    assert cli.status() == []
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())


@pytest.mark.parametrize("value", ["0.5", "90", "3600"])
def test_stop_grace_accepts_seconds_up_to_an_hour(cli: CLI, tmp_path: Path, value: str) -> None:
    task = _write(tmp_path / "t.yaml", f"name: ok\nstop_grace: {value}\nrun: 'true'\n")
    r = cli.run("up", str(task), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert cli.status() == []


def test_sighup_during_launch_down_stops_pulls_and_tears_down(cli: CLI, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    task = _write(tmp_path / "hup.yaml", f"""
name: hup
num_nodes: 2
envs:
  READY: {ready}
outputs: [ckpt/]
run: |
  trap 'sleep 1; mkdir -p ckpt; echo saved > ckpt/on-term; exit 143' TERM
  touch "$READY-$CLOUDTRAIN_NODE_RANK"
  sleep 600 &
  wait
""")
    proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "launch", str(task), "--down"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli.env(), start_new_session=True)
    try:
        assert wait_until(lambda: Path(f"{ready}-0").exists() and Path(f"{ready}-1").exists(),
                          120), "the job never started"
        # The terminal closes: its session's foreground process group gets SIGHUP.
        os.killpg(proc.pid, signal.SIGHUP)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err
    assert (tmp_path / "cloudtrain-outputs" / "ckpt" / "on-term").exists(), err
    assert (tmp_path / "cloudtrain-outputs" / "ckpt" / "on-term").read_text() == "saved\n"
    assert cli.status() == []
    assert_nothing_left(cli.home)


def test_launch_rolls_back_a_cluster_it_created_when_bootstrap_fails(cli: CLI,
                                                                    tmp_path: Path) -> None:
    task = _write(tmp_path / "boot.yaml", BOOT_FAILS)
    r = cli.run("launch", str(task))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "Rolling back" in r.stderr, r.stderr
    assert cli.status() == []
    assert_nothing_left(cli.home)


def test_launch_never_rolls_back_an_existing_cluster(cli: CLI, tmp_path: Path) -> None:
    task = _write(tmp_path / "boot.yaml", BOOT_FAILS.replace("bootfail", "keep"))
    assert cli.run("up", str(task), "--no-bootstrap").returncode == 0
    before = cli.status()
    # The cluster existed before this launch: its bootstrap failing does not remove it.
    r = cli.run("launch", str(task))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "Rolling back" not in r.stderr
    after = cli.status()
    assert [c["name"] for c in after] == ["keep"]
    assert [n["instance_id"] for n in after[0]["nodes"]] == \
        [n["instance_id"] for n in before[0]["nodes"]]
    assert cli.run("down", "keep", "-y").returncode == 0


def test_status_checks_ssh_clusters_live(cli: CLI, tmp_path: Path) -> None:
    hosts_task = _write(tmp_path / "hosts.yaml", "name: hosts\nnum_nodes: 2\nrun: 'true'\n")
    assert cli.run("up", str(hosts_task), "--no-bootstrap").returncode == 0
    hosts = cli.status()[0]["nodes"]
    key = cli.home / "clusters" / "hosts" / "ssh" / "id_ed25519"
    lines = "\n".join(
        f"      - {{address: {h['host']}, port: {h['port']}, identity_file: {key}}}" for h in hosts)
    mine = _write(tmp_path / "mine.yaml",
                  f"name: mine\nnum_nodes: 2\nresources:\n  provider: ssh\n  ssh:\n    hosts:\n"
                  f"{lines}\nrun: 'true'\n")
    assert cli.run("up", str(mine), "--no-bootstrap").returncode == 0
    st = {c["name"]: c for c in cli.status()}
    assert st["mine"]["status"] == "UP"
    assert [n["status"] for n in st["mine"]["nodes"]] == ["running", "running"]
    # Node 1's machine goes away (its sshd stops): status says so, within a bounded time.
    pidfile = cli.home / "clusters" / "hosts" / "local" / "nodes" / "1" / "sshd.pid"
    os.kill(int(pidfile.read_text()), signal.SIGTERM)
    assert wait_until(lambda: not processes_with(str(pidfile.parent / "sshd_config")), 10)
    # A plain status reaches no node: it shows the last contact's view at once.
    plain = cli.run("status")
    assert plain.returncode == 0 and "does not answer" not in plain.stderr, plain.stderr
    assert "--refresh" in plain.stderr
    t0 = time.monotonic()
    r = cli.run("status", "--refresh")
    assert time.monotonic() - t0 < 30
    assert r.returncode == 0, r.stderr
    assert "'mine' node 1" in r.stderr and "does not answer SSH" in r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("mine"))
    assert "DEGRADED" in row and f"1:{hosts[1]['host']}:{hosts[1]['port']}(unreachable)" in row
    st = {c["name"]: c for c in json.loads(cli.run("status", "--refresh", "--json").stdout)}
    assert [n["status"] for n in st["mine"]["nodes"]] == ["running", "unreachable"]
    assert cli.run("down", "mine", "hosts", "-y").returncode == 0


def test_exec_runs_with_the_tasks_envs(cli: CLI, tmp_path: Path) -> None:
    task = _write(tmp_path / "envs.yaml", """
name: envx
num_nodes: 2
envs:
  LR: "0.25"
  SECRET_TOKEN: s3cr3t-value
run: 'echo "lr=$LR"'
""")
    r = cli.run("launch", str(task), "--env", "EXTRA=yes")
    assert r.returncode == 0, r.stderr
    e = cli.run("exec", "envx", "--", 'echo "lr=$LR extra=$EXTRA tok=${#SECRET_TOKEN}"')
    assert e.returncode == 0, e.stderr
    assert "(node-0) lr=0.25 extra=yes tok=12" in e.stdout
    assert "(node-1) lr=0.25 extra=yes tok=12" in e.stdout
    # The values are never printed by cloudtrain itself.
    st = cli.run("status", "--json")
    assert "s3cr3t-value" not in st.stdout + st.stderr + e.stderr
    assert cli.run("down", "envx", "-y").returncode == 0
    assert_nothing_left(cli.home)
