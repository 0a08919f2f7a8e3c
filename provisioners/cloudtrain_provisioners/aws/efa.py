"""EFA on AWS: every EFA interface an instance type takes, one per network card, and the public
address a node with several interfaces needs.

The layout follows DescribeInstanceTypes (``NetworkInfo.EfaInfo.MaximumEfaInterfaces`` and
``NetworkInfo.NetworkCards``): the interface on network card 0, device 0 is ``efa`` (EFA and
an ordinary ENA interface in one: it carries the node's IP address); each further card gets
one at device 0, ``efa-only`` where the card takes that type (no IP address used: EFA traffic
only), else ``efa``. All of them in the cluster's subnet and security group (whose rule for
all traffic from the group itself lets EFA's SRD traffic through).

EC2 does not give an instance launched with more than one interface a public address
(``AssociatePublicIpAddress`` is refused then), so such a node gets an Elastic IP, tagged like
the cluster's other resources, associated with its first interface, released at teardown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from cloudtrain.provider import fabric
from cloudtrain.errors import UserError

from . import tags
from .api import Api
from .images import TypeInfo

RDMA_READ = ("p4d.", "p4de.", "p5.", "p5e.", "p5en.", "p6-", "trn1.", "trn1n.")
"""Types whose EFA does RDMA reads, so NCCL's OFI plugin may move GPU memory directly
(``FI_EFA_USE_DEVICE_RDMA=1``)."""


@dataclass(frozen=True)
class Layout:
    """The EFA interfaces of one node: (network card index, interface type) each."""

    interfaces: tuple[tuple[int, str], ...]

    @property
    def count(self) -> int:
        return len(self.interfaces)

    def text(self) -> str:
        only = sum(1 for _, t in self.interfaces if t == "efa-only")
        return (f"{self.count} EFA interface(s) on {self.count} network card(s)"
                + (f" ({only} efa-only)" if only else ""))


def layout(info: TypeInfo) -> Layout:
    """Every EFA interface ``info``'s type takes, one per network card, card 0 first."""
    cards = info.cards or ((0, False),)
    wanted = max(1, min(info.efa_max or 1, len(cards)))
    out = []
    for i, (card, efa_only) in enumerate(cards[:wanted]):
        out.append((card, "efa" if i == 0 or not efa_only else "efa-only"))
    return Layout(tuple(out))


def interfaces(lay: Layout | None, subnet_id: str, group_id: str,
               public_ip: bool) -> list[dict[str, Any]]:
    """RunInstances' NetworkInterfaces: one plain interface without EFA; else the layout's,
    a public address asked for only where EC2 allows it (a single interface)."""
    if lay is None:
        return [{"DeviceIndex": 0, "SubnetId": subnet_id, "Groups": [group_id],
                 "DeleteOnTermination": True, "AssociatePublicIpAddress": public_ip}]
    out = []
    for card, kind in lay.interfaces:
        nic: dict[str, Any] = {"NetworkCardIndex": card, "DeviceIndex": 0,
                               "SubnetId": subnet_id, "Groups": [group_id],
                               "DeleteOnTermination": True, "InterfaceType": kind}
        out.append(nic)
    if lay.count == 1:
        out[0]["AssociatePublicIpAddress"] = public_ip
    return out


def needs_elastic_ip(lay: Layout | None, public_ip: bool) -> bool:
    return public_ip and lay is not None and lay.count > 1


def node_env(instance_type: str) -> dict[str, str]:
    """What NCCL's OFI plugin (aws-ofi-nccl) needs to use EFA on this type."""
    env = {"FI_PROVIDER": "efa", "CLOUDTRAIN_FABRIC": "efa"}
    if instance_type.startswith(RDMA_READ):
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def primary_interface(d: dict[str, Any]) -> str:
    """The id of an instance's interface on network card 0, device 0 ('' when not listed)."""
    for n in d.get("NetworkInterfaces") or []:
        att = n.get("Attachment") or {}
        if int(att.get("DeviceIndex", -1)) == 0 and int(att.get("NetworkCardIndex", 0)) == 0:
            return str(n.get("NetworkInterfaceId") or "")
    return ""


def attach_public_ip(api: Api, region: str, instance_id: str, cluster: str, owner: str,
                     rank: int | None) -> None:
    """An Elastic IP for a node launched with several interfaces, on its first one (none when
    it has one already: a node adopted by a second ``up``). Tagged as it is made, so a
    teardown finds it whatever happens next."""
    found = api.call(region, "describe_instances", InstanceIds=[instance_id])
    (inst,) = [i for r in found.get("Reservations", []) for i in r.get("Instances", [])]
    eni = primary_interface(inst)
    if not eni or api.call(region, "describe_addresses", Filters=[
            {"Name": "network-interface-id", "Values": [eni]}]).get("Addresses"):
        return
    addr = api.call(region, "allocate_address", Domain="vpc",
                    TagSpecifications=tags.spec(["elastic-ip"],
                                                tags.tag_list(cluster, owner, "" if rank is None else rank)))
    api.call(region, "associate_address", AllocationId=addr["AllocationId"],
             NetworkInterfaceId=eni)


def chosen(setting: str | None, asked_efa: bool, info: TypeInfo, num_nodes: int) -> Layout | None:
    """The node's EFA layout for ``resources.network`` (and the older ``resources.aws.efa``,
    which asks for the fast network too); None: one plain interface. Asking for it on a type
    EC2 says has no EFA is the user's error, raised before anything is created."""
    if setting == "plain":
        return None
    if (setting == "fast" or asked_efa) and not info.efa:
        field = "resources.network: fast" if setting == "fast" else "resources.aws.efa"
        raise UserError(f"{field}: {info.name} does not support EFA. Nothing was created.",
                        "Pick an instance type with EFA ("
                        + ", ".join(fabric.with_fabric("aws")[:4]) + ", ...), or set "
                        "resources.network: plain.")
    if setting == "fast" or asked_efa:
        return layout(info)
    fab = fabric.wanted(None, "aws", info.name, num_nodes)
    return layout(info) if fab is not None and info.efa else None


def plan_text(setting: str | None, asked_efa: bool, instance_type: str, num_nodes: int) -> str:
    """The plan's words for the instances' interfaces."""
    fab = fabric.wanted("fast" if asked_efa and setting != "plain" else setting, "aws",
                        instance_type, num_nodes)
    if fab is None:
        return "; one network interface each"
    more = (f"; {fab.links} EFA interfaces each (one per network card; the first carries the "
            "IP address, the rest efa-only)" if fab.links > 1 else "; an EFA interface each")
    return more + (", an Elastic IP each (EC2 gives none to a node with several interfaces)"
                   if fab.links > 1 else "")


def attacher(api: Api, region: str, cluster: str, owner: str, lay: Layout | None,
             public_ip: bool) -> Callable[[Any], None] | None:
    """What ``wait_running`` calls for a running node without a public address: an Elastic
    IP where the node has several interfaces and wants one; None otherwise."""
    if not needs_elastic_ip(lay, public_ip):
        return None
    return lambda i: attach_public_ip(api, region, i.instance_id, cluster, owner, i.rank)
