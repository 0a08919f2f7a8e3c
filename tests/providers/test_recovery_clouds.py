"""Recovery end to end on the AWS fake (issue 13, docs/recovery.md), through the real CLI:
``cloudtrain launch --recover`` of a 2-node spot job on a moto server whose instances are
local sshd nodes reached through the tests' ssh_proxy (tests/fakes/standin.py; nothing ever
connects to an address moto invented: every cloudtrain process runs under test_aws_cli's
connection guard, and the proxy connects only to the nodes on loopback).

Mid-run the test takes node 1 as AWS does: moto terminates its instance with the spot
interruption reason (Server.SpotInstanceTermination) and its local node dies at once. The
controller sees EC2's answer, terminates what is left, creates a fresh instance in rank 1,
which the test's mapper gives a fresh local sshd node; the job resumes from the head's last
checkpoint and ends at the same step with the same data order as an uninterrupted run. The
ledger has one recovery with EC2's reason and its dollars; ``down`` leaves nothing in moto.

The false alarm: node 1's SSH is SIGSTOPped for longer than CLOUDTRAIN_NODE_TIMEOUT while EC2
says it runs: no recovery within the unresponsive window, the job finishes (issue 21)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import needs_sshd

pytest.importorskip("moto")
pytest.importorskip("boto3")

from aws_interruption import interrupt  # noqa: E402
from recovery_job import (order, recoveries, resumed_steps, sshd_processes, take,  # noqa: E402
                          uninterrupted_order, wait_or_fail, write_job)
import standin  # noqa: E402
from test_aws_cli import (FAKES, LocalNodes, _cloudtrain, _free_port, _guard_log,  # noqa: E402,F401
                          _moto, _tagged, aws_task, guarded, private_ips_file)

pytestmark = [needs_sshd, pytest.mark.e2e]

EMPTY = {"instances": 0, "security_groups": 0, "key_pairs": 0, "placement_groups": 0,
         "volumes": 0}

@pytest.fixture
def moto_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = _free_port()
    log = open(tmp_path / "moto.log", "w")
    env = {**os.environ, "MOTO_EC2_LOAD_DEFAULT_AMIS": "false",
           "CT_MOTO_PRIVATE_IPS": str(private_ips_file(tmp_path))}
    env.pop("MOTO_AMIS_PATH", None)
    code = (f"import sys; sys.path.insert(0, {str(FAKES)!r}); "
            f"import aws_interruption; aws_interruption.serve({port})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp_path / "moto.log").read_text()) from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


class Mapper(threading.Thread):
    """What the instances' "cloud-init" and the test's proxy map do: every running
    instance of the cluster gets a local sshd node of its own (rank r's first instance node
    r; any later instance, a replacement, the next spare node), which accepts the key of
    moto's key pair, presents the host key from the instance's user data and is bound to the
    instance (its guest shutdown tells moto); its public and private addresses then reach it
    through the proxy map (tests/fakes/standin.py)."""

    def __init__(self, ec2: Any, nodes: LocalNodes, cluster: str, map_file: Path) -> None:
        super().__init__(daemon=True)
        self.ec2, self.nodes, self.cluster, self.map_file = ec2, nodes, cluster, map_file
        self.stop_event = threading.Event()
        self.node_of: dict[str, int] = {}          # instance id -> local node index
        self.addresses: dict[str, tuple[str, int]] = {}
        self.spare = 2                            # nodes 0, 1: the first instances
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.wait(0.2):
                self.once()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def once(self) -> None:
        insts = [i for i in _tagged(self.ec2, self.cluster)["instances"]
                 if i["State"]["Name"] == "running" and i["InstanceId"] not in self.node_of]
        for i in insts:
            rank = int({t["Key"]: t["Value"] for t in i["Tags"]}["cloudtrain:node-rank"])
            used = set(self.node_of.values())
            k = rank if rank not in used else self.spare
            if k == self.spare:
                self.spare += 1
            (kp,) = self.ec2.describe_key_pairs(KeyNames=[i["KeyName"]],
                                                IncludePublicKey=True)["KeyPairs"]
            node = self.nodes.nodes[k]
            (node["dir"] / "authorized_keys").write_text(kp["PublicKey"].strip() + "\n")
            ud = self.ec2.describe_instance_attribute(InstanceId=i["InstanceId"],
                                                      Attribute="userData")["UserData"]
            if self.nodes.install_host_key(k, ud.get("Value")) is None \
                    and self.nodes.sshd.pid(node["dir"]) is None:
                standin.start(node["dir"])
            self.node_of[i["InstanceId"]] = k
            standin.bind(node["dir"], "aws", "--endpoint", self.ec2.meta.endpoint_url,
                         "--region", self.ec2.meta.region_name, "--instance", i["InstanceId"])
            self.addresses[i["PublicIpAddress"]] = (node["address"], node["port"])
            self.addresses[i["PrivateIpAddress"]] = (node["address"], node["port"])
            standin.ProxyMap(self.map_file).add(self.addresses)

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


TASK = """name: {name}
num_nodes: 2
resources:
  provider: aws
  region: us-east-1
  instance_type: g4dn.xlarge
  use_spot: true
  ssh_cidr: 127.0.0.1/32
  aws: {{host_key_wait: 0}}
workdir: proj
stop_grace: 5
recovery: {{poll_seconds: 1, max_recoveries: 1}}
run: python steps.py
"""


@pytest.fixture
def aws_world(guarded: dict[str, str], moto_server: str,  # type: ignore[no-untyped-def]
              tmp_path: Path):
    """(env for the CLI, moto client, the local nodes: 2 for the instances and 1 spare for a
    replacement, a function starting the mapper for a cluster)."""
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "CLOUDTRAIN_NODE_TIMEOUT": "30"}
    ec2 = _moto(moto_server)
    nodes = LocalNodes(tmp_path / "nodes", n=3)
    for n in nodes.nodes[:2]:
        standin.start(n["dir"])
    mappers: list[Mapper] = []

    def mapped(cluster: str) -> Mapper:
        m = Mapper(ec2, nodes, cluster, map_file)
        m.start()
        mappers.append(m)
        return m

    try:
        yield env, ec2, nodes, mapped
    finally:
        for m in mappers:
            m.finish()
        _cloudtrain(env, "down", "-a", "-y", timeout=300)
        nodes.stop()


def _rank_instances(ec2: Any, cluster: str) -> dict[int, dict[str, Any]]:
    return {int({t["Key"]: t["Value"] for t in i["Tags"]}["cloudtrain:node-rank"]): i
            for i in _tagged(ec2, cluster)["instances"]}


def _project(tmp_path: Path, name: str, nodes: LocalNodes) -> Path:
    write_job(tmp_path / "proj")
    task = tmp_path / f"{name}.yaml"
    task.write_text(TASK.format(name=name))
    return aws_task(task, tmp_path / "proxy-map.json", nodes)


def _popen(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cloudtrain", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_aws_spot_interruption_is_recovered_and_the_job_ends_as_uninterrupted(
        aws_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env, ec2, nodes, mapped = aws_world
    mapper = mapped("awsrec")
    head = nodes.nodes[0]["dir"] / "root"
    proc = _popen(env, "launch", str(_project(tmp_path, "awsrec", nodes)), "-y", "--recover")
    try:
        wait_or_fail(proc, lambda: len(order(head)) >= 10, 240, "the job did not train")
        before = _rank_instances(ec2, "awsrec")
        assert sorted(before) == [0, 1]
        assert all(i.get("InstanceLifecycle") == "spot" for i in before.values()), before
        interrupt(ec2, before[1]["InstanceId"])
        take(nodes.nodes[1]["dir"])
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = out + err
    assert proc.returncode == 0, text[-6000:]
    assert mapper.error is None, mapper.error
    assert (f"the cloud took node 1: instance {before[1]['InstanceId']} is terminated: "
            "spot capacity taken back") in text, text[-6000:]
    assert "Recovered: job" in text
    print(*[ln for ln in text.splitlines() if "Recovered: job" in ln])   # the phases, in s
    resumed = resumed_steps(text)
    assert resumed[0] == 0 and len(resumed) == 2 and resumed[1] >= 8, resumed
    assert order(head) == uninterrupted_order()      # same final step, same data order
    # rank 1 is a new instance on the spare node; rank 0 the same instance as before
    after = _rank_instances(ec2, "awsrec")
    assert after[0]["InstanceId"] == before[0]["InstanceId"]
    assert after[1]["InstanceId"] != before[1]["InstanceId"]
    assert after[1].get("InstanceLifecycle") == "spot"
    assert mapper.node_of[after[1]["InstanceId"]] == 2
    assert order(nodes.nodes[2]["dir"] / "root") == []       # rank 1 writes no order
    assert (nodes.nodes[2]["dir"] / "root" / "trainstate").is_dir(), "rank 1 did not run there"

    recs = recoveries(lambda *a: _cloudtrain(env, *a), "awsrec")
    assert len(recs) == 1, recs
    (r,) = recs
    assert r["ranks"] == [1] and r["status"] == "RECOVERED", r
    assert "spot capacity taken back" in str(r["reason"]), r
    assert before[1]["InstanceId"] in str(r["reason"]), r
    for k in ("detect_s", "replace_s", "bootstrap_s", "sync_s", "restart_s"):
        assert isinstance(r[k], float) and r[k] >= 0, (k, r)
    assert isinstance(r["replacement_usd"], float) and r["replacement_usd"] > 0, r
    assert r["detect_s"] < 5 and "unresponsive" not in str(r["reason"]), r  # at once, not after the window
    assert r["resumed_from"] == ("restarted from step 0 unless the job keeps its own checkpoint "
                                 "on the surviving head"), r      # no checkpoints: in TASK
    assert isinstance(r["lost_work_usd"], float) and r["lost_work_usd"] >= 0, r

    down = _cloudtrain(env, "down", "awsrec", "-y", timeout=300)
    assert down.returncode == 0, down.stderr[-3000:]
    assert {k: len(v) for k, v in _tagged(ec2, "awsrec").items()} == EMPTY
    every = [i for res in ec2.describe_instances()["Reservations"] for i in res["Instances"]]
    assert len(every) == 3 and {i["State"]["Name"] for i in every} == {"terminated"}
    assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []
    assert _guard_log(env) == ""
    relays = standin.ProxyMap(tmp_path / "proxy-map.json")
    assert relays.relayed and relays.only_loopback(), relays.relayed


def test_aws_ssh_outage_while_ec2_says_running_is_no_recovery(
        aws_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 21: node 1's SSH is silent for three node timeouts while EC2 says it runs: the
    launch waits (the unresponsive window is 600 s), reconnects, and nothing is replaced."""
    env, ec2, nodes, mapped = aws_world
    mapped("awsdrop")
    head = nodes.nodes[0]["dir"] / "root"
    proc = _popen({**env, "CLOUDTRAIN_NODE_TIMEOUT": "4"}, "launch",
                  str(_project(tmp_path, "awsdrop", nodes)), "-y", "--recover")
    try:
        wait_or_fail(proc, lambda: len(order(head)) >= 6, 240, "the job did not train")
        sshds = sshd_processes(nodes.nodes[1]["dir"])
        assert len(sshds) >= 2, sshds       # the listener and the job's session at least
        for p in sshds:              # node 1's SSH stalls, sessions too; EC2 says running
            os.kill(p, signal.SIGSTOP)
        try:
            time.sleep(12)           # three node timeouts, twelve polls
            assert proc.poll() is None, "the launch ended during the outage"
            states = {i["State"]["Name"] for i in _tagged(ec2, "awsdrop")["instances"]}
            assert states == {"running"}
        finally:
            for p in sshds:
                os.kill(p, signal.SIGCONT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out + err)[-6000:]
    assert "reconnecting (gives up after 600 s" in err, err[-6000:]
    assert "the cloud took" not in out + err and "unresponsive" not in out + err
    assert order(head) == uninterrupted_order()
    assert recoveries(lambda *a: _cloudtrain(env, *a), "awsdrop") == []
    assert len(_tagged(ec2, "awsdrop")["instances"]) == 2        # nothing was replaced
