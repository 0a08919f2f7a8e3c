"""The fast network on AWS against moto: what ``up`` asks EC2 for, read from the RunInstances
request as it went on the wire (the EC2 Query API's fields, as the API reference defines
them: ``NetworkInterface.N.NetworkCardIndex`` / ``DeviceIndex`` / ``InterfaceType``).

Where the facts come from: the provider reads each type's network cards and EFA limit from
DescribeInstanceTypes; moto answers it from its copy of EC2's published instance-type data,
which has p5.48xlarge's 32 network cards. The test compares the request with the catalog's
fabric table (written from AWS's instance-type pages), a source independent of moto.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from cloudtrain.provider.fabric import fabric_of  # noqa: E402
from cloudtrain.errors import UserError  # noqa: E402
from aws_moto import Harness  # noqa: E402

REGION = "us-east-1"


def _up(h: Harness, **resources: Any):  # type: ignore[no-untyped-def]
    req = h.request(accelerators=None, **resources)
    p = h.provider()
    p.check(req)
    p.plan(req)
    return p, p.create_nodes(req, p.ensure_network(req))


def _nics(sent: dict[str, str]) -> list[dict[str, str]]:
    """The NetworkInterface.N.* fields of one request, by N."""
    out: dict[int, dict[str, str]] = {}
    for k, v in sent.items():
        parts = k.split(".")
        if parts[0] == "NetworkInterface" and len(parts) >= 3:
            out.setdefault(int(parts[1]), {})[".".join(parts[2:])] = v
    return [out[n] for n in sorted(out)]


def _self_rule(h: Harness) -> bool:
    (sg,) = h.tagged()["security_groups"]
    return any(p["IpProtocol"] == "-1" and any(g["GroupId"] == sg["GroupId"]
                                               for g in p.get("UserIdGroupPairs", []))
               for p in sg["IpPermissions"])


@pytest.mark.parametrize("itype", ["p4d.24xlarge", "p5.48xlarge"])
def test_every_efa_interface_on_its_own_card_in_the_placement_group(aws: Harness,
                                                                    itype: str) -> None:
    fab = fabric_of("aws", itype)
    assert fab is not None and fab.links == {"p4d.24xlarge": 4, "p5.48xlarge": 32}[itype]
    p, nodes = _up(aws, instance_type=itype)
    runs = aws.faults.sent("RunInstances")
    assert len(runs) == 2 and len(nodes) == 2
    for run in runs:
        nics = _nics(run)
        assert len(nics) == fab.links
        assert [n["NetworkCardIndex"] for n in nics] == [str(i) for i in range(fab.links)]
        assert {n["DeviceIndex"] for n in nics} == {"0"}
        assert nics[0]["InterfaceType"] == "efa"              # carries the IP address
        assert {n["InterfaceType"] for n in nics[1:]} == {"efa-only"}
        assert not any("AssociatePublicIpAddress" in n for n in nics)   # EC2 refuses it here
        assert {n["SecurityGroupId.1"] for n in nics} == {nics[0]["SecurityGroupId.1"]}
        assert run["Placement.GroupName"].startswith("cloudtrain-demo-")
    assert _self_rule(aws)
    # a public address each all the same: an Elastic IP, tagged, on the first interface
    raw = aws.clients.raw(REGION)
    addrs = raw.describe_addresses(Filters=[{"Name": "tag:cloudtrain:cluster",
                                             "Values": ["demo"]}])["Addresses"]
    assert len(addrs) == 2 and {a["PublicIp"] for a in addrs} == {n.host for n in nodes}
    env = p.node_env("demo")
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    p.terminate("demo")
    assert raw.describe_addresses(Filters=[{"Name": "tag:cloudtrain:cluster",
                                            "Values": ["demo"]}])["Addresses"] == []


def test_a_type_without_efa_gets_one_plain_interface(aws: Harness) -> None:
    p, nodes = _up(aws, instance_type="g4dn.xlarge")
    for run in aws.faults.sent("RunInstances"):
        (nic,) = _nics(run)
        assert "InterfaceType" not in nic and "NetworkCardIndex" not in nic
        assert nic["DeviceIndex"] == "0" and nic["AssociatePublicIpAddress"] == "true"
    assert p.node_env("demo") == {}
    assert aws.clients.raw(REGION).describe_addresses()["Addresses"] == []


def test_plain_asked_and_one_node_get_one_plain_interface(aws: Harness) -> None:
    _up(aws, instance_type="p4d.24xlarge", network="plain")
    _up(aws, instance_type="p4d.24xlarge", name="solo", num_nodes=1)
    runs = aws.faults.sent("RunInstances")
    assert len(runs) == 3
    assert all(len(_nics(r)) == 1 and "InterfaceType" not in _nics(r)[0] for r in runs)


def test_one_efa_card_types_keep_their_public_address(aws: Harness) -> None:
    _up(aws, instance_type="g5.48xlarge")
    for run in aws.faults.sent("RunInstances"):
        (nic,) = _nics(run)
        assert nic["InterfaceType"] == "efa" and nic["AssociatePublicIpAddress"] == "true"
    assert aws.clients.raw(REGION).describe_addresses()["Addresses"] == []


def test_fast_on_a_type_without_efa_creates_nothing(aws: Harness) -> None:
    with pytest.raises(UserError, match="resources.network"):
        _up(aws, instance_type="g4dn.xlarge", network="fast")
    assert aws.faults.sent("RunInstances") == []
    assert aws.counts() == {k: 0 for k in aws.counts()}


def test_cards_without_efa_only_get_efa_interfaces() -> None:
    """A type whose further cards do not list efa-only (DescribeInstanceTypes'
    NetworkCards[].InterfaceTypes) gets 'efa' there; never more EFAs than the type takes."""
    from cloudtrain_provisioners.aws.efa import layout
    from cloudtrain_provisioners.aws.images import TypeInfo

    info = TypeInfo("x.48xlarge", "x86_64", True, True, 8, efa_max=2,
                    cards=((0, True), (1, False), (2, False)))
    assert layout(info).interfaces == ((0, "efa"), (1, "efa"))
