"""``cloudtrain stop`` / ``start`` through the real CLI on local nodes: stop refuses while a
job runs (unless --force), ends every node's sshd, records STOPPED and stops the ledger;
start brings the same nodes back (their files, their pinned host keys) and a launch works.
The ssh provider cannot stop its hosts: exit 2. Also ``launch -- CMD`` with no task file on
real nodes (the words reach the node quoted as they were typed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]

TASK = """\
name: ss
num_nodes: 2
resources:
  provider: local
  local:
    price_per_hour: 360
workdir: .
run: 'true'
"""


def sshd_of(cli: CLI, name: str, rank: int) -> list[int]:
    return processes_with(str(cli.home / "clusters" / name / "local" / "nodes" / str(rank)
                              / "sshd_config"))


def cluster(cli: CLI, name: str) -> dict[str, object]:
    return next(c for c in cli.status() if c["name"] == name)


def test_stop_and_start_local_nodes(cli: CLI, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.yaml").write_text(TASK)
    r = cli.run("launch", "task.yaml", "-y", "--", "printf", "%s|", "a b", "c;d",
                cwd=work)
    assert r.returncode == 0, r.stderr
    assert "(node-0) a b|c;d|" in r.stdout and "(node-1) a b|c;d|" in r.stdout
    assert cli.run("exec", "ss", "--", 'echo kept > "$HOME/kept"').returncode == 0
    before = cluster(cli, "ss")
    pins = cli.run("status", "ss", "--json").stdout

    # A job runs: stop refuses (exit 2), the nodes keep running.
    r = cli.run("launch", "task.yaml", "-y", "-d", "--", "sleep", "59.75", cwd=work)
    assert r.returncode == 0, r.stderr
    r = cli.run("stop", "ss", "-y")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is busy: job" in r.stderr and "--force" in r.stderr
    assert cluster(cli, "ss")["status"] == "UP" and sshd_of(cli, "ss", 0)

    r = cli.run("stop", "ss", "-y", "--force")
    assert r.returncode == 0, r.stderr
    assert "stopped: compute no longer bills" in r.stdout + r.stderr
    assert wait_until(lambda: not sshd_of(cli, "ss", 0) and not sshd_of(cli, "ss", 1), 10)
    assert not processes_with("sleep 59.75")
    st = cluster(cli, "ss")
    assert st["status"] == "STOPPED"
    assert [n["status"] for n in st["nodes"]] == ["stopped", "stopped"]  # type: ignore[index]
    # the ledger counts nothing while stopped ($360/h per node: $0.2/s for the cluster)
    spent = st["cost_so_far_usd"]
    time.sleep(1.5)
    assert cluster(cli, "ss")["cost_so_far_usd"] == spent
    r = cli.run("status")
    assert "STOPPED" in next(line for line in r.stdout.splitlines() if line.startswith("ss "))
    r = cli.run("stop", "ss", "-y")
    assert r.returncode == 0 and "stopped already" in r.stdout + r.stderr
    r = cli.run("status", "--refresh")                 # asks the provider: still STOPPED
    assert r.returncode == 0 and "STOPPED" in r.stdout, r.stderr
    for verb in (["exec", "ss", "--", "true"], ["logs", "ss"]):
        r = cli.run(*verb)
        assert r.returncode == 2 and "Cluster 'ss' is stopped" in r.stderr
        assert "cloudtrain start ss" in r.stderr

    r = cli.run("start", "ss", "-y")
    assert r.returncode == 0, r.stderr
    assert "is up again: 2 node(s)" in r.stdout + r.stderr
    after = cluster(cli, "ss")
    assert after["status"] == "UP"
    assert [(n["instance_id"], n["host"], n["port"]) for n in after["nodes"]] == [  # type: ignore[index]
        (n["instance_id"], n["host"], n["port"]) for n in before["nodes"]]  # type: ignore[index]
    assert sshd_of(cli, "ss", 0) and sshd_of(cli, "ss", 1)
    assert [n["host_key"] for n in after["nodes"]] == [  # type: ignore[index]
        n["host_key"] for n in before["nodes"]]  # type: ignore[index]
    assert '"host_key"' in pins
    r = cli.run("exec", "ss", "--", 'cat "$HOME/kept"')
    assert r.returncode == 0 and r.stdout.count("kept") == 2, r.stdout + r.stderr
    time.sleep(0.5)
    assert cluster(cli, "ss")["cost_so_far_usd"] > spent   # billing again
    r = cli.run("launch", "task.yaml", "-y", "--", "echo", "back", cwd=work)
    assert r.returncode == 0 and "(node-1) back" in r.stdout, r.stderr
    # no task file on an existing cluster: it is reused as it is (its 2 nodes, its price)
    r = cli.run("launch", "-c", "ss", "-y", "--dry-run", "--", "true", cwd=work)
    assert r.returncode == 0, r.stderr
    assert "'ss' is reused (UP, 2 node(s))" in r.stdout + r.stderr
    assert "$720.00/h for the cluster" in r.stdout + r.stderr
    r = cli.run("launch", "-c", "ss", "-y", "--", "echo", "again", cwd=work)
    assert r.returncode == 0 and "(node-1) again" in r.stdout, r.stderr
    assert cli.run("down", "ss", "-y").returncode == 0


def test_the_ssh_provider_cannot_stop(cli: CLI, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("name: hosts\nrun: 'true'\n")
    assert cli.run("up", str(hosts), "--no-bootstrap", "-y").returncode == 0
    h = cli.status()[0]["nodes"][0]  # type: ignore[index]
    key = cli.home / "clusters" / "hosts" / "ssh" / "id_ed25519"
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"name: mine\nresources:\n  provider: ssh\n  ssh:\n    hosts:\n      - "
                    f"{{address: {h['host']}, port: {h['port']}, identity_file: {key}}}\n"
                    "run: 'true'\n")
    assert cli.run("up", str(mine), "--no-bootstrap", "-y").returncode == 0
    for verb in ("stop", "start"):
        r = cli.run(verb, "mine", "-y")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Provider 'ssh' cannot stop or start its nodes" in r.stderr
        assert "cloudtrain down mine" in r.stderr
    assert cluster(cli, "mine")["status"] == "UP" and sshd_of(cli, "hosts", 0)
    r = cli.run("stop", "nosuch", "-y")
    assert r.returncode == 2 and "nosuch" in r.stderr
