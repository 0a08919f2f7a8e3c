"""Removing what cloudtrain created in a subscription, found by tag: a cluster's (``down``,
rollback) or every cluster's that no live cluster owns (``gc``).

A cluster lives in one resource group of its own, so teardown is: find the cluster's groups
(by the cluster and owner tags, and by the group's name), list what each holds, delete the
group (one long-running operation; Azure removes the VMs first, then what they used), then
check that the group and each resource it held answer "not found", and that nothing else in
the subscription still carries the cluster's tag. Each step is safe when there is nothing to
do, so a half-built cluster, a second ``down`` and a ``down`` with no local state all work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from cloudtrain.errors import ProviderError, code_of
from cloudtrain.provider import check_name

from . import tags
from .api import Api, as_dict, is_not_found

KINDS = {
    "microsoft.resources/resourcegroups": "resource-group",
    "microsoft.compute/virtualmachines": "virtual-machine",
    "microsoft.compute/disks": "disk",
    "microsoft.network/networkinterfaces": "network-interface",
    "microsoft.network/publicipaddresses": "public-ip",
    "microsoft.network/networksecuritygroups": "network-security-group",
    "microsoft.network/virtualnetworks": "virtual-network",
}
FORCE_DELETE = "Microsoft.Compute/virtualMachines"


@dataclass
class Resource:
    """One thing cloudtrain made, as ``gc`` lists it."""

    region: str
    kind: str
    id: str
    cluster: str
    owner: str
    created_at: str
    name: str = ""
    group: str = ""
    detail: str = ""

    @property
    def subscription(self) -> str:
        parts = self.id.split("/")
        return parts[2] if len(parts) > 2 and parts[1].lower() == "subscriptions" else ""

    def text(self) -> str:
        where = f" in {self.group}" if self.group and self.kind != "resource-group" else ""
        return (f"{self.region} {self.kind} {self.name or self.id}{where} (cluster {self.cluster or '?'}, "
                f"created {self.created_at or '?'} by {self.owner or '?'}){self.detail}")


def _name_from_id(rid: str) -> str:
    return rid.rstrip("/").split("/")[-1]


def _group_from_id(rid: str) -> str:
    parts = rid.split("/")
    for i, p in enumerate(parts):
        if p.lower() == "resourcegroups" and i + 1 < len(parts):
            return parts[i + 1]
    return ""


def find_groups(api: Api, cluster: str | None, owner: str | None,
                expected: str | None = None) -> list[dict[str, Any]]:
    """The resource groups tagged for ``cluster`` of ``owner`` (None: any cluster / any owner,
    but always something cloudtrain tagged); ``expected``: a group name looked up directly as
    well (lists can lag behind a create)."""
    if cluster is not None:
        check_name(cluster)     # defense in depth: only a valid name reaches the filter
    # OData string literal: a quote is doubled
    flt = f"tagName eq '{tags.CLUSTER}'" + (f" and tagValue eq '{cluster.replace(chr(39), chr(39) * 2)}'"
                                         if cluster else "")
    found = {str(g["name"]).lower(): g for g in
             (as_dict(x) for x in api.items("list resource groups",
                                            api.c.resource.resource_groups.list, filter=flt))}
    if expected and expected.lower() not in found:
        try:
            g = as_dict(api.call(f"read resource group {expected}",
                                 api.c.resource.resource_groups.get, expected))
            found[expected.lower()] = g
        except ProviderError as exc:
            if not is_not_found(exc):
                raise
    out = []
    for g in found.values():
        tg = g.get("tags") or {}
        if tags.CLUSTER not in tg or (cluster is not None and tg.get(tags.CLUSTER) != cluster):
            continue
        if owner is not None and tg.get(tags.OWNER) != owner:
            continue
        out.append(g)
    return sorted(out, key=lambda g: str(g["name"]))


def inventory(api: Api, group: str) -> list[dict[str, Any]]:
    """Every resource in ``group`` (id, name, type, location, tags)."""
    try:
        return [as_dict(r) for r in api.items(f"list resources of {group}",
                                               api.c.resource.resources.list_by_resource_group,
                                               group)]
    except ProviderError as exc:
        if is_not_found(exc):
            return []
        raise


def as_resources(group: dict[str, Any], inside: list[dict[str, Any]]) -> list[Resource]:
    tg = group.get("tags") or {}
    cluster, owner = tg.get(tags.CLUSTER, ""), tg.get(tags.OWNER, "")
    out = [Resource(str(group.get("location", "")), "resource-group", str(group["id"]), cluster,
                    owner, tg.get(tags.CREATED, ""), str(group["name"]), str(group["name"]),
                    f" [{len(inside)} resource(s)]")]
    for r in sorted(inside, key=lambda r: (str(r.get("type")), str(r.get("name")))):
        rt = r.get("tags") or {}
        out.append(Resource(str(r.get("location", "")),
                            KINDS.get(str(r.get("type", "")).lower(), str(r.get("type", ""))),
                            str(r["id"]), rt.get(tags.CLUSTER, cluster), rt.get(tags.OWNER, owner),
                            rt.get(tags.CREATED, ""), str(r.get("name", "")), str(group["name"])))
    return out


def delete_group(api: Api, group: str) -> None:
    """Delete ``group`` and everything in it; return when Azure says it is done. Gone
    already is fine."""
    try:
        api.lro(f"delete resource group {group}", api.c.resource.resource_groups.begin_delete,
                group, force_deletion_types=FORCE_DELETE)
    except ProviderError as exc:
        if code_of(exc) not in ("ResourceGroupNotFound", "NotFound"):
            raise


def _getter(api: Api, rtype: str) -> Callable[[str, str], Any] | None:
    c = api.c
    return {
        "microsoft.compute/virtualmachines": c.compute.virtual_machines.get,
        "microsoft.compute/disks": c.compute.disks.get,
        "microsoft.network/networkinterfaces": c.network.network_interfaces.get,
        "microsoft.network/publicipaddresses": c.network.public_ip_addresses.get,
        "microsoft.network/networksecuritygroups": c.network.network_security_groups.get,
        "microsoft.network/virtualnetworks": c.network.virtual_networks.get,
    }.get(rtype.lower())


def still_there(api: Api, group: str, held: list[dict[str, Any]], cluster: str,
                owner: str | None) -> list[str]:
    """What of ``group`` and the resources it ``held`` Azure still answers for, and what in
    the subscription still carries the cluster's tag inside that group."""
    left = []
    try:
        exists = api.call(f"check resource group {group}",
                          api.c.resource.resource_groups.check_existence, group)
    except ProviderError as exc:
        exists = not is_not_found(exc)
    if exists:
        left.append(f"resource group {group}")
    for r in held:
        get = _getter(api, str(r.get("type", "")))
        if get is None:
            continue
        try:
            api.call(f"read {r['name']}", get, _group_from_id(str(r["id"])), str(r["name"]))
        except ProviderError as exc:
            if is_not_found(exc):
                continue
            raise
        left.append(f"{KINDS.get(str(r['type']).lower(), r['type'])} {r['name']}")
    seen = {str(r["id"]).lower() for r in held}
    flt = f"tagName eq '{tags.CLUSTER}' and tagValue eq '{cluster}'"
    for r in api.items("list tagged resources", api.c.resource.resources.list, filter=flt):
        d = as_dict(r)
        rid = str(d.get("id", ""))
        # Tags are not returned by this filter: what is in this group is ours.
        if _group_from_id(rid).lower() == group.lower() and rid.lower() not in seen:
            left.append(f"{KINDS.get(str(d.get('type', '')).lower(), d.get('type'))} {d.get('name')}")
    return left


def teardown(api: Api, cluster: str, owner: str | None, *, expected: str | None = None,
             sleep: Callable[[float], None] = time.sleep, settle: int = 3,
             poll: float = 5.0) -> list[str]:
    """Remove every resource group of ``cluster`` (of ``owner``) and check each resource is
    gone. Returns the groups removed; raises ProviderError naming what is left."""
    groups = find_groups(api, cluster, owner, expected)
    removed = []
    problems: list[str] = []
    for g in groups:
        name = str(g["name"])
        held = inventory(api, name)
        delete_group(api, name)
        left = still_there(api, name, held, cluster, owner)
        for _ in range(settle):          # ARM's reads may lag a moment behind a delete
            if not left:
                break
            sleep(poll)
            left = still_there(api, name, held, cluster, owner)
        if left:
            problems.append(f"{name}: " + ", ".join(left[:6])
                            + ("" if len(left) <= 6 else f" and {len(left) - 6} more"))
        else:
            removed.append(name)
    if problems:
        raise ProviderError("after teardown, Azure still lists: " + "; ".join(problems) + ".",
                            "Run 'cloudtrain down' again; if it persists, delete the resource "
                            "group in the Azure portal.")
    return removed
