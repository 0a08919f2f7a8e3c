"""AWS and GCP nodes end their own billing with no credential on the node (issue 12).

Provider level, on the emulators: the self-stop command is a guest power-off that first
writes the guard's reason to the serial console; the fakes do what each cloud does on a guest
shutdown (EC2 terminates the instance, its root volume with it; GCE stops the VM, TERMINATED,
its boot disk left billing); ``self_stopped`` reads rank, time and reason back from the cloud;
``terminate`` (the next contact) leaves nothing. On GCP the task's max_hours becomes GCE's own
maxRunDuration with termination action DELETE, which the fake enforces on its clock.

End to end through the real CLI (tests further down): ``up`` of two mapped local sshd nodes,
the provider's self-stop command run on node 0 over ``cloudtrain exec``, the fake's view,
``self_stopped``, and ``down`` leaving nothing."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.provider import Node, SelfStops, registry  # noqa: E402
from cloudtrain.provider.addrmap import AddressMap  # noqa: E402
from aws_moto import MOTO_ACCOUNT, Harness as AWSHarness, add_images_to_moto, guest_shutdown  # noqa: E402
from aws_moto import hermetic_env as aws_env  # noqa: E402
from gce_fake import GCEFake, Harness as GCPHarness  # noqa: E402
from gce_fake import hermetic_env as gcp_env  # noqa: E402

REGION = "us-east-1"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from moto import mock_aws

    aws_env(monkeypatch)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with mock_aws():
        add_images_to_moto(REGION)
        yield AWSHarness(tmp_path / "home")
    registry.unregister_instance("aws")


@pytest.fixture
def gcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    gcp_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake(op_polls=1) as fake:
        fake.guard_env(monkeypatch)
        yield GCPHarness(fake, tmp_path / "home")
    registry.unregister_instance("gcp")


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


# --- test mode: the address map's shutdown command -------------------------------------------

def test_in_test_mode_the_map_gives_the_command_never_a_real_shutdown(tmp_path: Path) -> None:
    from cloudtrain.provider import ProviderContext
    from cloudtrain_provisioners.aws import AWSProvider
    from cloudtrain_provisioners.gcp import GCPProvider

    f = tmp_path / "map.json"
    f.write_text(json.dumps({"addresses": {
        "54.1.2.3": {"host": "127.0.0.9", "port": 2222, "shutdown": "stop-node a {instance_id}"},
        "54.1.2.4": {"host": "127.0.0.9", "port": 2223}}}))
    for cls in (AWSProvider, GCPProvider):
        p = cls(ProviderContext(tmp_path), clients=object(), address_map=AddressMap(f, "X"))
        assert p.self_stop_command("c", Node(0, "i-7", "127.0.0.9", 2222)) == "stop-node a i-7"
        other = p.self_stop_command("c", Node(1, "i-8", "127.0.0.9", 2223))
        assert "shutdown" not in other.replace("no shutdown command", "") and "exit 1" in other


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
