"""The AWS provider against moto: what it creates and how (network rules, tags, instance
settings, spot, image lookup, adoption). Assertions are about the requests our code makes
and the resources that result, read back from the emulator."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from cloudtrain.catalog.model import Offer  # noqa: E402
from cloudtrain.errors import UserError  # noqa: E402
from cloudtrain_provisioners.aws import tags as T  # noqa: E402
from cloudtrain_provisioners.aws.instances import parse_host_keys  # noqa: E402
from aws_moto import (NEWEST_DLAMI, TEST_CALLER_IP, Harness,  # noqa: E402
                      add_images_to_moto, dlami_images, host_key_console)

REGION = "us-east-1"
TAG_KEYS = {T.CLUSTER, T.RANK, T.OWNER, T.CREATED}
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")




def _up(h: Harness, req, **kw):  # type: ignore[no-untyped-def]
    p = h.provider(**kw)
    net = p.ensure_network(req)
    return p, p.create_nodes(req, net)


def _ingress(h: Harness) -> set[tuple[str, object, object, str]]:
    (sg,) = h.tagged()["security_groups"]
    out = set()
    for perm in sg["IpPermissions"]:
        proto = perm["IpProtocol"]
        ports = (None, None) if proto == "-1" else (perm.get("FromPort"), perm.get("ToPort"))
        for r in perm.get("IpRanges", []):
            out.add((proto, *ports, r["CidrIp"]))
        for r in perm.get("Ipv6Ranges", []):
            out.add((proto, *ports, r["CidrIpv6"]))
        for r in perm.get("UserIdGroupPairs", []):
            out.add((proto, *ports, "self" if r["GroupId"] == sg["GroupId"] else r["GroupId"]))
    return out


def test_security_group_has_exactly_the_rules_asked_for(aws: Harness) -> None:
    _up(aws, aws.request(ports=[8888, 6006]))
    me = f"{TEST_CALLER_IP}/32"
    assert _ingress(aws) == {("tcp", 22, 22, me), ("-1", None, None, "self"),
                             ("tcp", 6006, 6006, me), ("tcp", 8888, 8888, me)}
    (sg,) = aws.tagged()["security_groups"]
    assert "0.0.0.0/0" not in str(sg["IpPermissions"]) and "::/0" not in str(sg["IpPermissions"])
    # the default VPC of the region
    vpc = aws.clients.raw(REGION).describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])
    assert sg["VpcId"] == vpc["Vpcs"][0]["VpcId"]

    # A later up reconciles: the task's new range and ports replace the old rules exactly.
    _up(aws, aws.request(ports=[8888], ssh_cidr="198.51.100.0/24"))
    assert _ingress(aws) == {("tcp", 22, 22, "198.51.100.0/24"), ("-1", None, None, "self"),
                             ("tcp", 8888, 8888, "198.51.100.0/24")}
    assert len(aws.tagged()["security_groups"]) == 1


def test_open_to_the_world_only_when_the_user_writes_it(aws: Harness) -> None:
    _up(aws, aws.request(num_nodes=1, ssh_cidr="0.0.0.0/0"))
    assert _ingress(aws) == {("tcp", 22, 22, "0.0.0.0/0"), ("-1", None, None, "self")}


def test_caller_ip_is_looked_up_once_and_cached(aws: Harness) -> None:
    lookups = []

    def ip() -> str:
        lookups.append(1)
        return TEST_CALLER_IP

    _up(aws, aws.request(num_nodes=1), caller_ip=ip)
    assert lookups == [1]

    def broken() -> str:
        raise OSError("network unreachable")

    # another process (a new provider) uses the cached address
    _up(aws, aws.request(num_nodes=1), caller_ip=broken)
    assert ("tcp", 22, 22, f"{TEST_CALLER_IP}/32") in _ingress(aws)


def test_caller_ip_not_found_says_how_to_set_it_and_creates_nothing(aws: Harness) -> None:
    def broken() -> str:
        raise OSError("network unreachable")

    p = aws.provider(caller_ip=broken)
    with pytest.raises(UserError) as e:
        p.ensure_network(aws.request())
    assert "resources.ssh_cidr" in e.value.hint and "network unreachable" in e.value.message
    assert aws.counts() == {"instances": 0, "security_groups": 0, "key_pairs": 0,
                            "placement_groups": 0, "volumes": 0}


def _check_tags(tags: list[dict[str, str]], rank: str, owner: str, what: str) -> None:
    d = T.as_dict(tags)
    assert TAG_KEYS <= set(d), f"{what}: {d}"
    assert d[T.CLUSTER] == "demo" and d[T.OWNER] == owner and d[T.RANK] == rank, f"{what}: {d}"
    assert ISO.match(d[T.CREATED]), f"{what}: {d}"


def test_every_resource_kind_is_tagged(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(use_spot=True))
    held = aws.tagged()
    assert len(held["instances"]) == 2
    for i in held["instances"]:
        rank = T.as_dict(i["Tags"])[T.RANK]
        _check_tags(i["Tags"], rank, p.owner, "instance")
        vol_ids = [b["Ebs"]["VolumeId"] for b in i["BlockDeviceMappings"]]
        vols = [v for v in held["volumes"] if v["VolumeId"] in vol_ids]
        assert vols, "the root volume is tagged"
        for v in vols:
            _check_tags(v["Tags"], rank, p.owner, "volume")
    assert sorted(T.as_dict(i["Tags"])[T.RANK] for i in held["instances"]) == ["0", "1"]
    _check_tags(held["security_groups"][0]["Tags"], "all", p.owner, "security group")
    _check_tags(held["key_pairs"][0]["Tags"], "all", p.owner, "key pair")
    (pg,) = held["placement_groups"]
    _check_tags(pg["Tags"], "all", p.owner, "placement group")
    assert pg["Strategy"] == "cluster"
    # moto drops tags of network interfaces and spot requests: check what we asked for.
    for run in aws.faults.ops("RunInstances"):
        kinds = {s["ResourceType"]: s["Tags"] for s in run["TagSpecifications"]}
        assert set(kinds) == {"instance", "volume", "network-interface", "spot-instances-request"}
        rank = T.as_dict(kinds["instance"])[T.RANK]
        for k, tags in kinds.items():
            _check_tags(tags, rank, p.owner, k)


def test_instances_imdsv2_encrypted_root_terminate_on_shutdown_one_zone(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(disk_size_gb=321))
    raw = aws.clients.raw(REGION)
    insts = aws.tagged()["instances"]
    assert len(insts) == 2 and len(nodes) == 2
    assert [n.rank for n in nodes] == [0, 1]
    assert {i["Placement"]["AvailabilityZone"] for i in insts} == {"us-east-1a"}
    key = aws.tagged()["key_pairs"][0]["KeyName"]
    for i in insts:
        assert i["MetadataOptions"]["HttpTokens"] == "required"
        assert i["MetadataOptions"]["HttpEndpoint"] == "enabled"
        assert i["ImageId"] == NEWEST_DLAMI
        assert i["InstanceType"] == "p4d.24xlarge"
        assert i["KeyName"] == key
        attr = raw.describe_instance_attribute(InstanceId=i["InstanceId"],
                                               Attribute="instanceInitiatedShutdownBehavior")
        assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        (vol,) = raw.describe_volumes(Filters=[{"Name": "attachment.instance-id",
                                                "Values": [i["InstanceId"]]}])["Volumes"]
        assert vol["Encrypted"] is True and vol["Size"] == 321 and vol["VolumeType"] == "gp3"
    for run in aws.faults.ops("RunInstances"):
        assert run["Placement"]["GroupName"] == aws.tagged()["placement_groups"][0]["GroupName"]
        assert run["BlockDeviceMappings"][0]["Ebs"]["DeleteOnTermination"] is True
        assert "InstanceMarketOptions" not in run
    # nodes are reached at their public address, talk to each other at the private one
    by_id = {i["InstanceId"]: i for i in insts}
    for n in nodes:
        assert n.host == by_id[n.instance_id]["PublicIpAddress"]
        assert n.internal_ip == by_id[n.instance_id]["PrivateIpAddress"]
        assert n.user == "ubuntu" and n.status == "running" and not n.spot


def test_single_node_and_types_without_cluster_placement_get_no_placement_group(aws: Harness) -> None:
    _up(aws, aws.request(name="one", num_nodes=1))
    _up(aws, aws.request(name="burst", instance_type="t3.medium", accelerators=None))
    assert aws.tagged()["placement_groups"] == []
    assert all("GroupName" not in r["Placement"] for r in aws.faults.ops("RunInstances"))


def test_spot_market_options(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(use_spot=True, aws={"spot_max_price": 7.5}))
    for run in aws.faults.ops("RunInstances"):
        assert run["InstanceMarketOptions"] == {
            "MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time",
                                                  "InstanceInterruptionBehavior": "terminate",
                                                  "MaxPrice": "7.5000"}}
    assert all(i.get("InstanceLifecycle") == "spot" for i in aws.tagged()["instances"])
    assert all(n.spot for n in nodes)
    assert all(n.spot for n in p.list_nodes("demo"))


def test_spot_interruption_is_reported_as_such_and_the_node_replaced(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(use_spot=True))
    aws.faults.interrupt(REGION, nodes[1].instance_id)
    fresh = aws.provider()
    assert [n.rank for n in fresh.list_nodes("demo")] == [0]
    (msg,) = fresh.interruptions("demo")
    assert "node 1" in msg and "interrupted by AWS" in msg and "Server.SpotInstanceTermination" in msg
    again = fresh.create_nodes(aws.request(use_spot=True), None)  # type: ignore[arg-type]
    assert "interrupted by AWS" in aws.messages() and "launching a replacement" in aws.messages()
    assert again[0].instance_id == nodes[0].instance_id
    assert again[1].instance_id != nodes[1].instance_id
    assert fresh.interruptions("demo") == []


def test_dlami_lookup_newest_amazon_owned_for_the_architecture(aws: Harness) -> None:
    _up(aws, aws.request(name="x86", num_nodes=1))
    _up(aws, aws.request(name="arm", num_nodes=1, instance_type="g5g.xlarge", accelerators=None))
    images = {T.as_dict(i["Tags"])[T.CLUSTER]: i["ImageId"] for i in aws.tagged()["instances"]}
    assert images == {"x86": NEWEST_DLAMI, "arm": "ami-0d1a0000000000004"}
    for call in aws.faults.ops("DescribeImages"):
        assert call["Owners"] == ["amazon"]


def test_dlami_base_image_when_the_region_has_no_pytorch_one(aws: Harness) -> None:
    base = [i for i in dlami_images() if "Base" in i["name"]]
    add_images_to_moto("us-west-2", base)
    _up(aws, aws.request(num_nodes=1, region="us-west-2"))
    (inst,) = aws.tagged("us-west-2")["instances"]
    assert inst["ImageId"] == base[0]["ami_id"]


def test_image_override_and_disk_smaller_than_image(aws: Harness) -> None:
    _up(aws, aws.request(num_nodes=1, image="ami-0d1a0000000000001"))
    assert aws.tagged()["instances"][0]["ImageId"] == "ami-0d1a0000000000001"
    with pytest.raises(UserError, match="disk_size_gb 10 is smaller"):
        _up(aws, aws.request(name="small", num_nodes=1, disk_size_gb=10))


def test_second_up_adopts_and_never_double_creates(aws: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.context import open_env
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.spec import parse_task
    from cloudtrain.ui import UI

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(aws.home))
    task = parse_task("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: aws\n"
                      "  region: us-east-1\n  accelerators: A100:8\n  aws: {host_key_wait: 0}\n")
    env = open_env(UI(quiet=True), {"aws": aws.provider()})
    h1, fresh1 = provision(env, task, "demo")
    first = [n.instance_id for n in h1.nodes]
    assert fresh1 and len(first) == 2
    # a new process: state says UP, the provider confirms, nothing is called to create
    env.providers = {"aws": aws.provider()}
    aws.faults.calls.clear()
    h2, fresh2 = provision(env, task, "demo")
    assert not fresh2 and [n.instance_id for n in h2.nodes] == first
    assert not [o for _, o, _ in aws.faults.calls if o.startswith(("Run", "Create", "Import"))]
    # state lost: the provider finds the nodes again by tag and adopts them
    env.state.delete_cluster("demo")
    h3, _ = provision(env, task, "demo")
    assert [n.instance_id for n in h3.nodes] == first
    assert aws.counts() == {"instances": 2, "security_groups": 1, "key_pairs": 1,
                            "placement_groups": 1, "volumes": 2}
    # one node gone: only that rank is launched again, in the cluster's zone
    aws.clients.raw(REGION).terminate_instances(InstanceIds=[first[1]])
    env.providers = {"aws": aws.provider()}
    h4, _ = provision(env, task, "demo")
    ids = [n.instance_id for n in h4.nodes]
    assert ids[0] == first[0] and ids[1] != first[1]
    assert len(aws.tagged()["instances"]) == 2
    assert {i["Placement"]["AvailabilityZone"] for i in aws.tagged()["instances"]} == {"us-east-1a"}


def test_host_keys_read_from_the_console_are_pinned(aws: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.context import open_env
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.spec import parse_task
    from cloudtrain.ui import UI

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBmC0Tq8VhYdX3jFv2lqfT9K3r8mJb7xkN2p9wQe4sLr"
    # the instance ids are unknown before launch: answer every console request with the keys
    monkeypatch.setattr(aws.faults, "console", _Every(host_key_console([key])))
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(aws.home))
    task = parse_task("name: demo\nrun: echo hi\nresources:\n  provider: aws\n"
                      "  region: us-east-1\n  accelerators: A100:8\n"
                      "  aws: {host_key_wait: 5, inject_host_key: false}\n")
    handle, _ = provision(open_env(UI(quiet=True), {"aws": aws.provider()}), task, "demo")
    assert aws.sleeps == []     # found on the first look: no waiting
    node = handle.nodes[0]
    assert handle.learn == frozenset()   # nothing is learned on first contact: it is pinned
    assert f"{node.host} {key}" in handle.keys.known_hosts.read_text().splitlines()
    assert parse_host_keys(host_key_console([key, "ssh-rsa short"])) == (key,)
    assert parse_host_keys("no keys here") == ()


class _Every(dict):  # type: ignore[type-arg]
    """A mapping that has every key (console output for any instance)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: object) -> str:
        return self.text


def test_console_without_keys_waits_then_learns_on_first_contact(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(num_nodes=1, aws={"host_key_wait": 0.01,
                                                      "inject_host_key": False}))
    assert nodes[0].host_keys == ()


def test_check_refuses_what_cannot_work(aws: Harness) -> None:
    p = aws.provider()
    with pytest.raises(UserError, match="not in region"):
        p.check(aws.request(region="us-east-1", zone="us-west-2a"))
    with pytest.raises(UserError, match="needs resources.accelerators"):
        p.check(aws.request(accelerators=None))
    with pytest.raises(UserError, match="subnet_ids"):
        p.check(aws.request(aws={"vpc_id": "vpc-0123"}))
    with pytest.raises(UserError, match="does not support EFA"):
        _up(aws, aws.request(instance_type="t3.medium", accelerators=None, aws={"efa": True}))
    assert aws.counts()["instances"] == 0


def test_efa_interface_where_supported(aws: Harness) -> None:
    _up(aws, aws.request(aws={"efa": True}))
    for run in aws.faults.ops("RunInstances"):
        assert run["NetworkInterfaces"][0]["InterfaceType"] == "efa"


def test_accelerators_pick_the_catalog_instance_type(aws: Harness) -> None:
    offers = [Offer("aws", "g5.xlarge", "A10G", 1, 24, 4, 16, REGION, price=1.0),
              Offer("aws", "g6.xlarge", "L4", 1, 24, 4, 16, REGION, price=0.8)]
    p, nodes = _up(aws, aws.request(num_nodes=1, accelerators="L4:1", offers=lambda: offers),
                   offers=lambda: offers)
    assert aws.tagged()["instances"][0]["InstanceType"] == "g6.xlarge"
    plan = aws.provider(offers=lambda: offers).plan(aws.request(num_nodes=1, accelerators="L4:1",
                                                                offers=lambda: offers))
    assert plan.instance_type == "g6.xlarge" and plan.hourly_price_per_node == 0.8


def test_loading_the_provider_imports_no_sdk(tmp_path: Path) -> None:
    code = ("import sys\nfrom pathlib import Path\n"
            "from cloudtrain.provider import ProviderContext\n"
            "from cloudtrain_provisioners.aws import AWSProvider\n"
            "p = AWSProvider(ProviderContext(Path(sys.argv[1])))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore')))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_stopped_node_is_started_again_not_replaced(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(num_nodes=1))
    raw = aws.clients.raw(REGION)
    raw.stop_instances(InstanceIds=[nodes[0].instance_id])
    fresh = aws.provider()
    assert [n.status for n in fresh.list_nodes("demo")] == ["stopped"]
    again = fresh.create_nodes(aws.request(num_nodes=1), None)  # type: ignore[arg-type]
    assert [n.instance_id for n in again] == [nodes[0].instance_id]
    assert again[0].status == "running"
    assert aws.faults.ops("StartInstances") == [{"InstanceIds": [nodes[0].instance_id]}]
    assert len(aws.faults.ops("RunInstances")) == 1


def test_configured_vpc_and_subnets(aws: Harness) -> None:
    raw = aws.clients.raw(REGION)
    vpc = raw.create_vpc(CidrBlock="10.10.0.0/16")["Vpc"]["VpcId"]
    sub_c = raw.create_subnet(VpcId=vpc, CidrBlock="10.10.2.0/24",
                              AvailabilityZone="us-east-1c")["Subnet"]["SubnetId"]
    sub_b = raw.create_subnet(VpcId=vpc, CidrBlock="10.10.1.0/24",
                              AvailabilityZone="us-east-1b")["Subnet"]["SubnetId"]
    aws.faults.fail("RunInstances", "InsufficientInstanceCapacity", zone="us-east-1c")
    p, nodes = _up(aws, aws.request(network="plain",   # one interface: a public address at launch
                                    aws={"vpc_id": vpc, "subnet_ids": [sub_c, sub_b]}))
    assert aws.tagged()["security_groups"][0]["VpcId"] == vpc
    # the subnets' zones, in the order given; all nodes in the one that had room
    assert [r["Placement"]["AvailabilityZone"] for r in aws.faults.ops("RunInstances")] == [
        "us-east-1c", "us-east-1c", "us-east-1b", "us-east-1b"]
    assert {i["SubnetId"] for i in aws.tagged()["instances"]} == {sub_b}
    for run in aws.faults.ops("RunInstances"):
        assert run["NetworkInterfaces"][0]["AssociatePublicIpAddress"] is True
    default_sub = raw.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])
    with pytest.raises(UserError, match="are not in"):
        _up(aws, aws.request(name="other", aws={"vpc_id": vpc, "subnet_ids": [
            default_sub["Subnets"][0]["SubnetId"]]}))


def test_each_new_node_gets_an_injected_host_key_pinned_at_creation(aws: Harness) -> None:
    """The default: a host key pair per node, made by cloudtrain and passed in the user data
    (cloud-init's ssh_keys), reported as the node's key without reading any console."""
    import base64

    from cloudtrain.keys import host_key_from_cloud_config

    p, nodes = _up(aws, aws.request())
    raw = aws.clients.raw(REGION)
    seen = []
    for n in nodes:
        ud = raw.describe_instance_attribute(InstanceId=n.instance_id,
                                             Attribute="userData")["UserData"]["Value"]
        pair = host_key_from_cloud_config(base64.b64decode(ud).decode())
        assert pair is not None and n.host_keys == (pair[1],)
        seen.append(pair[1])
    assert len(set(seen)) == 2                       # one key per node
    assert len(aws.faults.ops("RunInstances")) == 2 and all(
        r["UserData"] for r in aws.faults.ops("RunInstances"))
    assert aws.faults.ops("GetConsoleOutput") == []  # nothing read from the console
    assert p.list_nodes("demo") == nodes             # listed again with the same keys
