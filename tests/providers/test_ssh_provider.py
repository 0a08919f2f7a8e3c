"""The ssh provider on machines the user already has: here, the sshd nodes of a local cluster
stand in for the user's hosts."""

from __future__ import annotations


import json
import sys
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]


def test_ssh_provider_up_launch_down_never_powers_off(cli: CLI, tmp_path: Path) -> None:
    hosts_task = tmp_path / "hosts.yaml"
    hosts_task.write_text("name: hosts\nnum_nodes: 2\nrun: 'true'\n")
    r = cli.run("up", str(hosts_task), "--no-bootstrap")
    assert r.returncode == 0, r.stderr
    hosts = cli.status()[0]["nodes"]
    key = cli.home / "clusters" / "hosts" / "ssh" / "id_ed25519"
    entries = "\n".join(
        f"      - {{address: {h['host']}, port: {h['port']}, identity_file: {key}}}" for h in hosts)
    task = tmp_path / "mine.yaml"
    task.write_text(f"""
name: mine
num_nodes: 2
resources:
  provider: ssh
  ssh:
    hosts:
{entries}
bootstrap:
  python: {sys.executable}
run: |
  echo "on $CLOUDTRAIN_NODE_RANK head=$CLOUDTRAIN_HEAD_IP"
  sleep 300 &
  wait
""")
    dry = cli.run("up", str(task), "--dry-run")
    assert dry.returncode == 0 and "never powers them off" in dry.stderr
    up = cli.run("up", str(task))
    assert up.returncode == 0, up.stderr
    assert "bootstrapped" in up.stderr
    # Host keys were learned on first contact and pinned for this cluster.
    kh = (cli.home / "clusters" / "mine" / "ssh" / "known_hosts").read_text()
    assert all(f"[{h['host']}]:{h['port']}" in kh for h in hosts)

    d = cli.run("launch", str(task), "-d")
    assert d.returncode == 0, d.stderr
    assert wait_until(lambda: len(processes_with("CLOUDTRAIN_CLUSTER=mine")) >= 2, 30)
    down = cli.run("down", "mine", "-y")
    assert down.returncode == 0, down.stderr
    # Our processes on the hosts are stopped, the hosts themselves keep running.
    assert wait_until(lambda: not processes_with("CLOUDTRAIN_CLUSTER=mine"), 10)
    st = cli.status()
    assert [c["name"] for c in st] == ["hosts"]
    assert {n["status"] for n in st[0]["nodes"]} == {"running"}


def test_ssh_provider_host_count_must_match(cli: CLI, tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_text("x")
    task = tmp_path / "t.yaml"
    task.write_text(json.dumps({
        "name": "bad", "num_nodes": 3, "run": "true",
        "resources": {"provider": "ssh", "ssh": {"hosts": [{"address": "127.0.0.1", "identity_file": str(key)}]}},
    }))
    r = cli.run("up", str(task))
    assert r.returncode == 2
    assert "num_nodes is 3" in r.stderr and "1 host" in r.stderr
    assert cli.status() == []
