"""AWS and GCP nodes end their own billing with no credential on the node (issue 12).

Provider level, on the emulators: the self-stop command is a guest power-off that first
writes the guard's reason to the serial console; the fakes do what each cloud does on a guest
shutdown (EC2 terminates the instance, its root volume with it; GCE stops the VM, TERMINATED,
its boot disk left billing); ``self_stopped`` reads rank, time and reason back from the cloud;
``terminate`` (the next contact) leaves nothing. On GCP the task's max_hours becomes GCE's own
maxRunDuration with termination action DELETE, which the fake enforces on its clock.

End to end through the real CLI (tests further down): ``up`` of two local sshd nodes standing
in for the instances (tests/fakes/standin.py), the provider's real self-stop command run on
node 0 over ``cloudtrain exec`` (the stand-in's own ``sudo``/``shutdown`` emulations tell the
fake, tests/fakes/guest_shutdown.py), the fake's view,
``self_stopped``, and ``down`` leaving nothing. And the lost laptop on both fakes (with the
node guard): ``launch --down`` of a 2-node job, the CLI SIGKILLed mid-run; the job completes,
each node's guard powers it off, the cloud ends it its own way, and the next contact
(``status --refresh``) shows the cluster gone and leaves nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DEMO, needs_sshd, needs_torch, processes_with, wait_until

pytest.importorskip("moto")
pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.provider import Node, SelfStops  # noqa: E402
import standin  # noqa: E402
from aws_moto import MOTO_ACCOUNT, Harness as AWSHarness, add_images_to_moto, guest_shutdown  # noqa: E402
from aws_moto import hermetic_env as aws_env  # noqa: E402
from gce_fake import GCEFake, Harness as GCPHarness  # noqa: E402
from gce_fake import hermetic_env as gcp_env  # noqa: E402
from test_aws_cli import (TASK as AWS_TASK, LocalNodes, _cloudtrain, _map_when_running,  # noqa: E402,F401
                          _moto, _tagged, aws_task, guarded, moto_server)
from test_gcp_e2e import NAT, world  # noqa: E402,F401

REGION = "us-east-1"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from moto import mock_aws

    aws_env(monkeypatch)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with mock_aws():
        add_images_to_moto(REGION)
        yield AWSHarness(tmp_path / "home")


@pytest.fixture
def gcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    gcp_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake(op_polls=1) as fake:
        fake.guard_env(monkeypatch)
        yield GCPHarness(fake, tmp_path / "home")


# --- AWS --------------------------------------------------------------------------------------

def test_aws_command_is_a_guest_poweroff_with_the_reason_on_the_console(aws: AWSHarness) -> None:
    p = aws.provider()
    assert isinstance(p, SelfStops)
    cmd = p.self_stop_command("demo", Node(0, "i-1", "54.1.2.3"))
    assert "shutdown -P now" in cmd and "sudo -n" in cmd
    assert "cloudtrain-guard: stop: ${CT_GUARD_REASON" in cmd and "/dev/ttyS0" in cmd
    bills = p.what_still_bills()
    assert "nothing for compute" in bills and "security group" in bills and "gc" in bills


def test_aws_guest_shutdown_terminates_the_node_and_the_next_contact_leaves_nothing(
        aws: AWSHarness) -> None:
    from moto.ec2.models import ec2_backends

    p = aws.provider()
    req = aws.request(num_nodes=2)
    nodes = p.create_nodes(req, p.ensure_network(req))
    raw = aws.clients.raw(REGION)
    ids = [n.instance_id for n in sorted(nodes, key=lambda n: n.rank)]
    # what makes a guest shutdown end the billing: terminate on shutdown, root volume with it
    for i in ids:
        attr = raw.describe_instance_attribute(InstanceId=i,
                                               Attribute="instanceInitiatedShutdownBehavior")
        assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    (res,) = raw.describe_instances(InstanceIds=[ids[0]])["Reservations"]
    assert all(m["Ebs"]["DeleteOnTermination"] for m in res["Instances"][0]["BlockDeviceMappings"])
    assert p.self_stopped("demo") == []

    before = time.time()
    aws.faults.console_output(ids[0], "[  1.0] boot\ncloudtrain-guard: stop: budget\n")
    guest_shutdown(ec2_backends[MOTO_ACCOUNT][REGION], [ids[0]], "budget")

    (res,) = raw.describe_instances(InstanceIds=[ids[0]])["Reservations"]
    inst = res["Instances"][0]
    assert inst["State"]["Name"] == "terminated"
    assert inst["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"
    (stop,) = p.self_stopped("demo")
    assert (stop.rank, stop.instance_id, stop.reason) == (0, ids[0], "budget")
    assert before - 2 <= stop.stopped_at <= time.time() + 1
    assert [n.rank for n in p.list_nodes("demo")] == [1]
    # what a self-stop leaves (free), until the next contact
    left = aws.counts(REGION, "demo")
    assert left["security_groups"] == 1 and left["key_pairs"] == 1 and left["instances"] == 1
    # the other node stops itself too (no reason readable): then the next contact
    guest_shutdown(ec2_backends[MOTO_ACCOUNT][REGION], [ids[1]])
    assert [(s.rank, s.reason) for s in p.self_stopped("demo")] == [(0, "budget"), (1, None)]
    p.terminate("demo")
    assert aws.counts(REGION, "demo") == {"instances": 0, "security_groups": 0, "key_pairs": 0,
                                          "placement_groups": 0, "volumes": 0}


def test_aws_a_user_termination_is_not_a_self_stop(aws: AWSHarness) -> None:
    p = aws.provider()
    req = aws.request(num_nodes=1)
    (node,) = p.create_nodes(req, p.ensure_network(req))
    aws.clients.raw(REGION).terminate_instances(InstanceIds=[node.instance_id])
    assert p.self_stopped("demo") == []


def test_aws_a_replaced_node_is_no_longer_reported(aws: AWSHarness) -> None:
    """After ``up`` replaced a node that stopped itself, the cluster has it again."""
    from moto.ec2.models import ec2_backends

    p = aws.provider()
    req = aws.request(num_nodes=2)
    nodes = p.create_nodes(req, p.ensure_network(req))
    guest_shutdown(ec2_backends[MOTO_ACCOUNT][REGION], [nodes[0].instance_id], "idle")
    assert [s.rank for s in p.self_stopped("demo")] == [0]
    again = p.create_nodes(req, p.ensure_network(req))
    assert sorted(n.rank for n in again) == [0, 1]
    assert p.self_stopped("demo") == []
    p.terminate("demo")


# --- GCP --------------------------------------------------------------------------------------

def test_gcp_guest_shutdown_stops_the_vm_its_disk_bills_until_the_next_contact(
        gcp: GCPHarness) -> None:
    p, nodes = gcp.up(gcp.request())
    assert isinstance(p, SelfStops)
    cmd = p.self_stop_command("demo", nodes[0])
    assert "shutdown -P now" in cmd and "cloudtrain-guard: stop: ${CT_GUARD_REASON" in cmd
    assert "boot disk" in p.what_still_bills() and "maxRunDuration" in p.what_still_bills()
    assert p.self_stopped("demo") == []
    (inst,) = [i for i in gcp.fake.instances.values() if i["name"].endswith("-0")]
    zone = inst["zone"].rsplit("/", 1)[-1]
    before = time.time()
    gcp.fake.guest_shutdown(zone, inst["name"], "idle")

    assert gcp.fake.instances[(zone, inst["name"])]["status"] == "TERMINATED"
    assert len(gcp.fake.disks) == 2           # the boot disk stays, and bills
    (stop,) = p.self_stopped("demo")
    assert (stop.rank, stop.reason) == (0, "idle")
    assert stop.instance_id.startswith(inst["name"] + "/")
    (other,) = [i for i in gcp.fake.instances.values() if i["name"].endswith("-1")]
    gcp.fake.guest_shutdown(zone, other["name"])          # nothing on its serial port
    assert [(s.rank, s.reason) for s in p.self_stopped("demo")] == [(0, "idle"), (1, None)]
    assert before - 2 <= stop.stopped_at <= time.time() + 1
    p.terminate("demo")                       # the next contact
    assert gcp.fake.empty(), gcp.fake.ours()


def test_gcp_max_hours_is_gces_own_run_duration_with_delete(gcp: GCPHarness) -> None:
    req = dataclasses.replace(gcp.request(), max_hours=0.01)
    assert "maxRunDuration 36 s" in "; ".join(gcp.provider().plan(req).creates)
    p, _ = gcp.up(req)
    for body in gcp.fake.inserted_instances():
        assert body["scheduling"]["maxRunDuration"] == {"seconds": "36"}
        assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    gcp.fake.advance(20)
    assert len(p.list_nodes("demo")) == 2
    gcp.fake.advance(20)                      # GCE deletes the nodes and their disks itself
    assert p.list_nodes("demo") == [] and gcp.fake.instances == {} and gcp.fake.disks == {}
    p.terminate("demo")
    assert gcp.fake.empty(), gcp.fake.ours()


def test_gcp_without_max_hours_no_run_duration(gcp: GCPHarness) -> None:
    gcp.up(gcp.request(num_nodes=1))
    (body,) = gcp.fake.inserted_instances()
    assert "maxRunDuration" not in body["scheduling"]
    assert body["scheduling"].get("instanceTerminationAction") is None


# --- the guest power-off, and its emulation on the stand-in nodes ------------------------------

def test_the_self_stop_is_always_the_real_guest_power_off(tmp_path: Path) -> None:
    from cloudtrain.provider import ProviderContext
    from cloudtrain_provisioners.aws import AWSProvider
    from cloudtrain_provisioners.aws import selfstop as aws_stop
    from cloudtrain_provisioners.gcp import GCPProvider
    from cloudtrain_provisioners.gcp import selfstop as gcp_stop

    for cls, stop in ((AWSProvider, aws_stop), (GCPProvider, gcp_stop)):
        p = cls(ProviderContext(tmp_path), clients=object())
        cmd = p.self_stop_command("c", Node(0, "i-7", "54.1.2.3"))
        assert cmd == stop.COMMAND and "sudo -n shutdown -P now" in cmd


@needs_sshd
def test_a_stand_in_shadows_every_power_command(tmp_path: Path) -> None:
    """On a stand-in node every command that could power the (test) machine off is the
    emulation; an unbound node refuses to power off; a PATH where a real one would run is
    refused before the node starts."""
    d = tmp_path / "node0"
    standin.prepare(d, address="127.0.0.1", port=1, user="root", marker="shadow-test")
    env = standin.environ_of(d)
    for name in (*standin.POWER, "sudo"):
        found = subprocess.run(["/bin/sh", "-c", f"command -v {name}"], capture_output=True,
                               text=True, env={"PATH": env["PATH"]}).stdout.strip()
        assert found == str(d / "bin" / name)
    r = subprocess.run(["/bin/sh", "-c", "sudo -n shutdown -P now"], capture_output=True,
                       text=True, env={"PATH": env["PATH"]}, timeout=60)
    assert r.returncode == 1 and "no instance bound" in r.stderr and not (d / "powered-off").exists()
    r = subprocess.run(["/bin/sh", "-c", "sudo -n systemctl restart x; sudo -n reboot"],
                       capture_output=True, text=True, env={"PATH": env["PATH"]}, timeout=60)
    assert r.returncode == 1 and r.stderr.count("not emulated") == 2
    (d / "bin" / "poweroff").unlink()
    with pytest.raises(RuntimeError, match="'poweroff' on its PATH is .*not the emulation"):
        standin.start(d)


def test_times_and_reasons_are_read_from_the_clouds_own_words() -> None:
    from cloudtrain_provisioners.aws import selfstop as aws_stop
    from cloudtrain_provisioners.gcp import selfstop as gcp_stop

    assert aws_stop.stopped_at("User initiated (2026-11-24 01:02:03 GMT)") == 1795482123.0
    assert aws_stop.stopped_at("") is None
    assert gcp_stop.stopped_at("2026-11-24T01:02:03.000+00:00") == 1795482123.0
    assert aws_stop.reason_in("x\ncloudtrain-guard: stop: idle\ncloudtrain-guard: stop: budget\n") \
        == "budget"
    assert gcp_stop.reason_in("cloudtrain-guard: stop: unknown\n") is None
    assert gcp_stop.run_seconds(None) is None and gcp_stop.run_seconds(0.001) == 30
    assert gcp_stop.run_seconds(2) == 7200


# --- end to end through the CLI, on mapped local sshd nodes ------------------------------------


EMPTY = {"instances": 0, "security_groups": 0, "key_pairs": 0, "placement_groups": 0,
         "volumes": 0}


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), 1).close()
        return True
    except OSError:
        return False


def _self_stop_over_exec(run, provider, cluster: str, node: Node, reason: str):  # type: ignore[no-untyped-def]
    """What the node guard does as its last act, here over ``cloudtrain exec``: the
    provider's self-stop command with $CT_GUARD_REASON set. The node goes away under it."""
    cmd = provider.self_stop_command(cluster, node)
    return run("exec", cluster, "--node", str(node.rank), "--",
               f"CT_GUARD_REASON={reason}; export CT_GUARD_REASON; {cmd}")


@needs_sshd
@needs_torch
@pytest.mark.e2e
def test_aws_node_stops_itself_through_the_cli(guarded: dict[str, str], moto_server: str,
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.provider import ProviderContext
    from cloudtrain_provisioners.aws import AWSProvider

    proj = tmp_path / "proj"
    shutil.copytree(DEMO, proj, ignore=shutil.ignore_patterns("cloudtrain-outputs", "__pycache__"))
    task = proj / "task.yaml"
    task.write_text(AWS_TASK.format(name="awsstop", region="  region: us-east-1\n"))
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    ec2 = _moto(moto_server)
    nodes = LocalNodes(tmp_path / "nodes")
    aws_task(task, map_file, nodes)
    nodes.start()
    seen: dict[str, object] = {}
    stop = threading.Event()
    mapper = threading.Thread(target=_map_when_running,
                              args=(ec2, nodes, "awsstop", map_file, seen, stop), daemon=True)
    mapper.start()
    try:
        r = _cloudtrain(env, "up", str(task), "-y", timeout=300)
        assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
        insts = {int({t["Key"]: t["Value"] for t in i["Tags"]}["cloudtrain:node-rank"]): i
                 for i in _tagged(ec2, "awsstop")["instances"]}
        for k, v in {"AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
                     "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"
                     }.items():
            monkeypatch.setenv(k, v)
        p = AWSProvider(ProviderContext(Path(env["CLOUDTRAIN_HOME"])))
        node0 = next(n for n in p.list_nodes("awsstop") if n.rank == 0)
        assert node0.instance_id == insts[0]["InstanceId"]
        before = time.time()
        _self_stop_over_exec(lambda *a: _cloudtrain(env, *a, timeout=120), p, "awsstop",
                             node0, "job-end")

        # EC2's answer to a guest shutdown: the instance is terminated (by the instance)
        def state(rank: int) -> dict:  # type: ignore[type-arg]
            (res,) = ec2.describe_instances(InstanceIds=[insts[rank]["InstanceId"]])["Reservations"]
            return res["Instances"][0]  # type: ignore[no-any-return]
        assert wait_until(lambda: state(0)["State"]["Name"] == "terminated", 20)
        assert state(0)["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"
        assert state(1)["State"]["Name"] == "running"
        # the guard's line went to the node's serial console (the stand-in's is a file)
        assert "cloudtrain-guard: stop: job-end" in (n := nodes.nodes[0]["dir"] / "console.log"
                                                     ).read_text(), n
        # ...and the node is gone: its sshd no longer listens, node 1's still does
        n0, n1 = nodes.nodes
        assert wait_until(lambda: not _listening(n0["address"], n0["port"]), 10)
        assert _listening(n1["address"], n1["port"])
        (s,) = p.self_stopped("awsstop")
        assert (s.rank, s.instance_id, s.reason) == (0, insts[0]["InstanceId"], "job-end")
        assert before - 2 <= s.stopped_at <= time.time() + 1
        # the next contact removes everything, the survivor included
        r = _cloudtrain(env, "down", "awsstop", "-y", timeout=300)
        assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
        assert {k: len(v) for k, v in _tagged(ec2, "awsstop").items()} == EMPTY
        assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []
    finally:
        stop.set()
        mapper.join(timeout=10)
        nodes.stop()


@needs_sshd
@needs_torch
@pytest.mark.e2e
def test_gcp_node_stops_itself_through_the_cli(world, tmp_path: Path,  # type: ignore[no-untyped-def]
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.provider import ProviderContext
    from cloudtrain_provisioners.gcp import GCPProvider

    cli, env, fake, nodes, _ = world
    task = tmp_path / "task.yaml"
    task.write_text("name: gcpstop\nnum_nodes: 2\nrun: echo hi\n"
                    "resources:\n  provider: gcp\n  region: us-central1\n  accelerators: T4:1\n"
                    "  ssh_cidr: 198.51.100.7/32\n")
    nodes.use(task)
    r = cli.run("up", str(task), "-y", timeout=300, **env)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    insts = {int(i["labels"]["cloudtrain-node-rank"]): i for i in fake.instances.values()}
    # which local node each rank's external address maps to
    local = {r: NAT.index(i["networkInterfaces"][0]["accessConfigs"][0]["natIP"])
             for r, i in insts.items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(cli.home))
    p = GCPProvider(ProviderContext(cli.home))
    node0 = next(n for n in p.list_nodes("gcpstop") if n.rank == 0)
    before = time.time()
    _self_stop_over_exec(lambda *a: cli.run(*a, timeout=120, **env), p, "gcpstop", node0, "idle")

    # GCE's answer to a guest shutdown: the VM is stopped (TERMINATED), its boot disk kept
    key0 = (insts[0]["zone"].rsplit("/", 1)[-1], insts[0]["name"])
    assert wait_until(lambda: fake.instances[key0]["status"] == "TERMINATED", 20)
    assert len(fake.disks) == 2
    rank1 = (insts[1]["zone"].rsplit("/", 1)[-1], insts[1]["name"])
    assert fake.instances[rank1]["status"] == "RUNNING"
    assert "natIP" not in fake.instances[key0]["networkInterfaces"][0]["accessConfigs"][0]
    assert wait_until(lambda: not _listening(*nodes.addrs[local[0]]), 10)
    assert _listening(*nodes.addrs[local[1]])
    (s,) = p.self_stopped("gcpstop")
    assert (s.rank, s.reason) == (0, "idle") and before - 2 <= s.stopped_at <= time.time() + 1
    # the next contact removes everything: both instances, the disks, the rules, the network
    r = cli.run("down", "gcpstop", "-y", timeout=300, **env)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    assert fake.empty(), fake.ours()
    assert cli.run("status", "--json", **env).stdout.strip() == "[]"


# --- lost laptop: launch --down, the CLI SIGKILLed, the cluster ends itself ---------------------


FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}
JOB = "  sleep 6\n  touch {marks}/done-$CLOUDTRAIN_NODE_RANK\n"


def _lost_laptop(proc: subprocess.Popen[str], cluster: str, marks: Path) -> None:
    """Once the job runs on both nodes, SIGKILL the CLI; the job still completes."""
    try:
        assert wait_until(lambda: len(processes_with(f"CLOUDTRAIN_CLUSTER={cluster}")) >= 2,
                          240), "the job did not start"
    finally:
        proc.send_signal(signal.SIGKILL)       # the laptop is gone
        proc.wait(timeout=10)
    assert wait_until(lambda: len(list(marks.iterdir())) == 2, 60), "the job did not complete"


@needs_sshd
@pytest.mark.e2e
def test_aws_lost_laptop_the_cluster_ends_itself(guarded: dict[str, str], moto_server: str,
                                                 tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    task = tmp_path / "lost.yaml"
    task.write_text("name: lostaws\nnum_nodes: 2\nstop_grace: 5\n"
                    "resources:\n  provider: aws\n  region: us-east-1\n"
                    "  instance_type: g4dn.xlarge\n  ssh_cidr: 127.0.0.1/32\n"
                    "  aws: {host_key_wait: 0}\n"
                    "run: |\n" + JOB.format(marks=marks))
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, **FAST, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    ec2 = _moto(moto_server)
    nodes = LocalNodes(tmp_path / "nodes")
    aws_task(task, map_file, nodes)
    nodes.start()
    seen: dict[str, object] = {}
    stop = threading.Event()
    # (it binds each node to its instance before bootstrap installs the guard)
    mapper = threading.Thread(target=_map_when_running, daemon=True,
                              args=(ec2, nodes, "lostaws", map_file, seen, stop))
    mapper.start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "launch", str(task), "-y",
                                 "--down"], env=env, text=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _lost_laptop(proc, "lostaws", marks)

        # no further command: each node's guard powers it off, EC2 terminates it
        def states() -> set[str]:
            return {i["State"]["Name"] for r in ec2.describe_instances(Filters=[
                {"Name": "tag:cloudtrain:cluster", "Values": ["lostaws"]}])["Reservations"]
                for i in r["Instances"]}
        assert wait_until(lambda: states() == {"terminated"}, 60), states()
        assert wait_until(lambda: not any(_listening(n["address"], n["port"])
                                          for n in nodes.nodes), 10)
        left = {k: len(v) for k, v in _tagged(ec2, "lostaws").items()}
        assert left["instances"] == 0 and left["security_groups"] == 1   # free, until contact
        # the next contact: status --refresh sees the self-stop and removes what is left
        r = _cloudtrain(env, "status", "--refresh", "--json", timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        (entry,) = [e for e in json.loads(r.stdout) if e["name"] == "lostaws"]
        assert entry["status"] == "GONE" and entry["reason"] == "job-end", entry
        assert {k: len(v) for k, v in _tagged(ec2, "lostaws").items()} == EMPTY
        assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []
    finally:
        stop.set()
        mapper.join(timeout=10)
        nodes.stop()


@needs_sshd
@pytest.mark.e2e
def test_gcp_lost_laptop_the_cluster_ends_itself(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake, nodes, _ = world
    marks = tmp_path / "marks"
    marks.mkdir()
    task = tmp_path / "lost.yaml"
    task.write_text("name: lostgcp\nnum_nodes: 2\nstop_grace: 5\n"
                    "resources:\n  provider: gcp\n  region: us-central1\n  accelerators: T4:1\n"
                    "  ssh_cidr: 198.51.100.7/32\n"
                    "run: |\n" + JOB.format(marks=marks))
    nodes.use(task)
    proc = cli.popen("launch", str(task), "-y", "--down", **env, **FAST)
    _lost_laptop(proc, "lostgcp", marks)
    # no further command: each node's guard powers it off, GCE stops it (disks still there)
    assert wait_until(lambda: {i["status"] for i in fake.instances.values()} == {"TERMINATED"},
                      60), {i["name"]: i["status"] for i in fake.instances.values()}
    assert len(fake.disks) == 2
    assert wait_until(lambda: not any(_listening(*a) for a in nodes.addrs), 10)
    # the next contact deletes the stopped VMs, their disks, the rules and the network
    r = cli.run("status", "--refresh", "--json", timeout=300, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    (entry,) = [e for e in json.loads(r.stdout) if e["name"] == "lostgcp"]
    assert entry["status"] == "GONE" and entry["reason"] == "job-end", entry
    assert fake.empty(), fake.ours()
    assert cli.run("status", "--json", **env).stdout.strip() == "[]"
