"""Removing what cloudtrain created in a region, found by tag: a cluster's (``down``, rollback)
or every cluster's that no live cluster owns (``gc``).

Order: terminate the instances and wait until EC2 says terminated (their network interfaces
and volumes go with them), then delete the security group (retried while EC2 still reports
a DependencyViolation: interfaces take a while to be released), the key pair and the
placement group, then any volume, interface or Elastic IP left over, then check that nothing tagged is
left. Each step is safe when there is nothing to do, so a half-built cluster, a second
``down`` and a ``down`` with no local state all work.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from cloudtrain.errors import ProviderError, code_of

from . import instances
from . import tags
from .api import Api

GONE = ("InvalidGroup.NotFound", "InvalidKeyPair.NotFound", "InvalidPlacementGroup.Unknown",
        "InvalidVolume.NotFound", "InvalidNetworkInterfaceID.NotFound",
        "InvalidAllocationID.NotFound")
RETRY_WHILE = ("DependencyViolation", "InvalidPlacementGroup.InUse", "VolumeInUse",
               "InvalidNetworkInterface.InUse", "InvalidIPAddress.InUse")


@dataclass
class Resource:
    region: str
    kind: str          # instance | security-group | key-pair | placement-group | volume |
                       # network-interface | elastic-ip
    id: str
    cluster: str
    owner: str
    created_at: str
    name: str = ""
    detail: str = ""

    def text(self) -> str:
        extra = f" {self.name}" if self.name and self.name != self.id else ""
        return f"{self.region} {self.kind} {self.id}{extra} (cluster {self.cluster}, " \
               f"created {self.created_at or '?'} by {self.owner or '?'}){self.detail}"


@dataclass
class Found:
    """Everything tagged in one region, for one cluster (or all)."""

    resources: list[Resource] = field(default_factory=list)

    def of(self, kind: str) -> list[Resource]:
        return [r for r in self.resources if r.kind == kind]


def _res(region: str, kind: str, rid: str, tag_list: list[dict[str, str]] | None, name: str = "",
         detail: str = "") -> Resource:
    t = tags.as_dict(tag_list)
    return Resource(region, kind, rid, t.get(tags.CLUSTER, ""), t.get(tags.OWNER, ""),
                    t.get(tags.CREATED, ""), name, detail)


def find(api: Api, region: str, cluster: str | None, owner: str | None) -> Found:
    """Every resource in ``region`` tagged for ``cluster`` of ``owner`` (None: any)."""
    flt = tags.filters(cluster, owner)
    out = Found()
    for i in instances.describe(api, region, cluster, owner):
        out.resources.append(Resource(region, "instance", i.instance_id, i.cluster, i.owner,
                                      i.created_at, detail=f" [{i.state}]"))
    for g in api.pages(region, "describe_security_groups", "SecurityGroups", Filters=flt):
        out.resources.append(_res(region, "security-group", g["GroupId"], g.get("Tags"),
                                  g.get("GroupName", "")))
    for k in api.call(region, "describe_key_pairs", Filters=flt).get("KeyPairs", []):
        out.resources.append(_res(region, "key-pair", k.get("KeyPairId") or k["KeyName"],
                                  k.get("Tags"), k["KeyName"]))
    for p in api.call(region, "describe_placement_groups", Filters=flt).get("PlacementGroups", []):
        if p.get("State") in ("deleted",):
            continue
        out.resources.append(_res(region, "placement-group", p.get("GroupId") or p["GroupName"],
                                  p.get("Tags"), p["GroupName"]))
    for v in api.pages(region, "describe_volumes", "Volumes",
                       Filters=flt + [{"Name": "status", "Values": ["available", "error"]}]):
        out.resources.append(_res(region, "volume", v["VolumeId"], v.get("Tags")))
    for a in api.call(region, "describe_addresses", Filters=flt).get("Addresses", []):
        out.resources.append(_res(region, "elastic-ip", a["AllocationId"], a.get("Tags"),
                                  a.get("PublicIp", "")))
    for n in api.pages(region, "describe_network_interfaces", "NetworkInterfaces",
                       Filters=flt + [{"Name": "status", "Values": ["available"]}]):
        out.resources.append(_res(region, "network-interface", n["NetworkInterfaceId"],
                                  n.get("TagSet")))
    return out


def _delete(api: Api, region: str, op: str, sleep: Callable[[float], None], timeout: float,
            **params: str) -> None:
    """Delete one thing; gone already is fine; retried while EC2 says it is still in use."""
    deadline = time.monotonic() + timeout
    delay = 2.0
    while True:
        try:
            api.call(region, op, **params)
            return
        except ProviderError as exc:
            code = code_of(exc)
            if code in GONE:
                return
            if code not in RETRY_WHILE or time.monotonic() >= deadline:
                raise
        sleep(delay)
        delay = min(delay * 1.5, 15.0)


def teardown_region(api: Api, region: str, cluster: str, owner: str | None, *,
                    sleep: Callable[[float], None], timeout: float = 900.0) -> None:
    """Remove everything tagged for ``cluster`` (of ``owner``) in ``region``; return when EC2
    lists none of it."""
    insts = instances.describe(api, region, cluster, owner)
    ids = [i.instance_id for i in insts]
    if ids:
        instances.terminate_ids(api, region, [i.instance_id for i in insts if i.state != "shutting-down"])
        instances.wait_terminated(api, region, ids, sleep=sleep, timeout=timeout)
    found = find(api, region, cluster, owner)
    for r in found.of("security-group"):
        _delete(api, region, "delete_security_group", sleep, 300.0, GroupId=r.id)
    for r in found.of("key-pair"):
        _delete(api, region, "delete_key_pair", sleep, 60.0, KeyName=r.name)
    for r in found.of("placement-group"):
        _delete(api, region, "delete_placement_group", sleep, 120.0, GroupName=r.name)
    for r in found.of("volume"):
        _delete(api, region, "delete_volume", sleep, 120.0, VolumeId=r.id)
    for r in found.of("network-interface"):
        _delete(api, region, "delete_network_interface", sleep, 120.0, NetworkInterfaceId=r.id)
    for r in found.of("elastic-ip"):   # the instances are gone: released, not disassociated
        _delete(api, region, "release_address", sleep, 60.0, AllocationId=r.id)
    left = find(api, region, cluster, owner).resources
    if left:
        raise ProviderError(
            f"after teardown, {region} still lists: " + "; ".join(r.text() for r in left[:6])
            + ("" if len(left) <= 6 else f"; and {len(left) - 6} more") + ".",
            "Run 'cloudtrain down' again; if it persists, remove them in the EC2 console.")


def group_by_cluster(resources: list[Resource]) -> dict[tuple[str, str, str], list[Resource]]:
    """(region, cluster, owner) -> its resources."""
    out: dict[tuple[str, str, str], list[Resource]] = defaultdict(list)
    for r in resources:
        out[(r.region, r.cluster, r.owner)].append(r)
    return dict(out)
