"""The cluster's network boundary in one region: its resource group, the network security
group and its rules, the VNet and its one subnet.

The NSG (on the subnet) allows exactly: TCP 22 from the caller's range, everything from
inside the VNet (the nodes talk to each other: NCCL, gloo, torch rendezvous), the task's
``ports`` (TCP) from the caller's range; a last rule denies every other inbound flow, so
Azure's default rules (which also admit peered networks and the load balancer) never apply.
Nothing is open to the Internet unless the user's ``ssh_cidr`` says so. The NSG is written
with PUT, which replaces its rules: after every ``up`` they match the task exactly.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import ProviderError, code_of

from . import tags
from .api import Api, as_dict

PRIORITY_SSH = 100
PRIORITY_VNET = 110
PRIORITY_PORTS = 200
PRIORITY_DENY = 4096


@dataclass(frozen=True)
class Rule:
    """One inbound NSG rule."""

    name: str
    priority: int
    access: str            # Allow | Deny
    protocol: str          # Tcp | *
    source: str            # a CIDR, or * (only on the final deny)
    destination: str
    port: str              # "22", or "*"

    def text(self) -> str:
        what = "all traffic" if self.protocol == "*" else f"tcp {self.port}"
        if self.access == "Deny":
            return "deny every other inbound flow"
        return f"{what} from {self.source}"

    def body(self) -> dict[str, Any]:
        return {"name": self.name, "properties": {
            "priority": self.priority, "direction": "Inbound", "access": self.access,
            "protocol": self.protocol, "sourceAddressPrefix": self.source,
            "sourcePortRange": "*", "destinationAddressPrefix": self.destination,
            "destinationPortRange": self.port,
            "description": "cloudtrain: " + self.text()}}


def subnet_cidr(vnet_cidr: str) -> str:
    net = ipaddress.ip_network(vnet_cidr)
    return str(next(net.subnets(new_prefix=max(net.prefixlen, 20))))


def desired_rules(cidr: str, ports: list[int], vnet_cidr: str) -> list[Rule]:
    rules = [Rule("ct-ssh", PRIORITY_SSH, "Allow", "Tcp", cidr, vnet_cidr, "22"),
             Rule("ct-vnet", PRIORITY_VNET, "Allow", "*", vnet_cidr, vnet_cidr, "*")]
    rules += [Rule(f"ct-port-{p}", PRIORITY_PORTS + i, "Allow", "Tcp", cidr, vnet_cidr, str(p))
              for i, p in enumerate(sorted(set(ports)))]
    rules.append(Rule("ct-deny-inbound", PRIORITY_DENY, "Deny", "*", "*", "*", "*"))
    return rules


@dataclass
class RegionNet:
    region: str
    group: str
    nsg_id: str
    vnet_id: str
    subnet_id: str


class GroupElsewhere(ProviderError):
    """The cluster's resource group exists in another region."""

    def __init__(self, group: str, location: str) -> None:
        super().__init__(f"resource group {group} is in {location}")
        self.location = location


def get_group(api: Api, name: str) -> dict[str, Any] | None:
    try:
        return as_dict(api.call(f"read resource group {name}",
                                api.c.resource.resource_groups.get, name))
    except ProviderError as exc:
        if code_of(exc) in ("ResourceGroupNotFound", "ResourceNotFound", "NotFound"):
            return None
        raise


def ensure_group(api: Api, name: str, region: str, tag_map: dict[str, str]) -> dict[str, Any]:
    """Create the cluster's resource group in ``region`` (or adopt it there)."""
    g = get_group(api, name)
    if g is not None:
        mine = g.get("tags") or {}
        if mine.get(tags.CLUSTER) != tag_map[tags.CLUSTER] or mine.get(tags.OWNER) != tag_map[tags.OWNER]:
            raise ProviderError(f"A resource group named {name} exists without cloudtrain's tags "
                                f"for '{tag_map[tags.CLUSTER]}'.",
                                "Delete it, or use another cluster name.")
        if str(g.get("location", "")).lower() != region.lower():
            raise GroupElsewhere(name, str(g.get("location")))
        return g
    return as_dict(api.call(f"create resource group {name} in {region}",
                            api.c.resource.resource_groups.create_or_update, name,
                            {"location": region, "tags": tag_map}))


def ensure_network(api: Api, group: str, region: str, rules: list[Rule], vnet_cidr: str,
                   tag_map: dict[str, str]) -> RegionNet:
    nsg = as_dict(api.lro(f"write network security group {tags.NSG} in {region}",
                          api.c.network.network_security_groups.begin_create_or_update,
                          group, tags.NSG, {"location": region, "tags": tag_map,
                                         "properties": {"securityRules": [r.body() for r in rules]}}))
    vnet = as_dict(api.lro(
        f"write virtual network {tags.VNET} in {region}",
        api.c.network.virtual_networks.begin_create_or_update, group, tags.VNET,
        {"location": region, "tags": tag_map,
         "properties": {"addressSpace": {"addressPrefixes": [vnet_cidr]},
                        "subnets": [{"name": tags.SUBNET, "properties": {
                            "addressPrefix": subnet_cidr(vnet_cidr),
                            "networkSecurityGroup": {"id": nsg["id"]}}}]}}))
    subnet = next(s for s in vnet["properties"]["subnets"] if s["name"] == tags.SUBNET)
    return RegionNet(region, group, nsg["id"], vnet["id"], subnet["id"])


def rules_of(nsg: dict[str, Any]) -> list[dict[str, Any]]:
    """The inbound rules of an NSG as ARM returns them (for tests and ``status``)."""
    return [r for r in (nsg.get("properties") or {}).get("securityRules", [])
            if (r.get("properties") or {}).get("direction") == "Inbound"]
