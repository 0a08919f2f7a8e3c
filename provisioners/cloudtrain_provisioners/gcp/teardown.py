"""Removing what cloudtrain created in a project, found by its marks: a cluster's (``down``,
rollback) or every cluster's that no live cluster owns (``gc``).

Order: delete the instances and wait until each delete operation is DONE and the instance
list no longer shows them (their auto-delete boot disks go with them), then delete any disk
left over with our labels, then the firewall rules, then the GPU NIC subnetworks (A3), then
the cluster's own VPC networks (when cloudtrain created them), then check that nothing marked is left.
Each step is safe when there is nothing to do, so a half-built cluster, a second ``down``
and a ``down`` with no local state all work: everything is found by label (instances,
disks) or by the marks in the description (firewall rules), in every zone at once through
the aggregated lists.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from cloudtrain.errors import ProviderError

from . import compact
from . import gpunics
from . import instances
from . import tags
from . import network
from .api import Api, NotFound


@dataclass
class Resource:
    region: str        # the zone (instances, disks), region (subnetworks) or "global"
    kind: str          # instance | disk | resource-policy | firewall | subnetwork | network
    id: str
    cluster: str
    owner: str
    created_at: str
    name: str = ""
    detail: str = ""
    project: str = ""
    credentials_file: str | None = None

    def text(self) -> str:
        extra = f" {self.name}" if self.name and self.name != self.id else ""
        return (f"{self.region} {self.kind} {self.id}{extra} (cluster {self.cluster}, "
                f"created {self.created_at or '?'} by {self.owner or '?'}){self.detail}")


@dataclass
class Found:
    resources: list[Resource] = field(default_factory=list)

    def of(self, kind: str) -> list[Resource]:
        return [r for r in self.resources if r.kind == kind]


def find(api: Api, project: str, cluster: str | None, owner: str | None) -> Found:
    """Everything in ``project`` marked for ``cluster`` of ``owner`` (None: any)."""
    out = Found()
    for i in instances.describe(api, project, cluster, owner):
        out.resources.append(Resource(i.zone, "instance", i.name, i.cluster, i.owner,
                                      i.created_at, detail=f" [{i.status}]"))
    for d in api.aggregated("disks", project, "disks", tags.instance_filter(cluster, owner)):
        if d.get("users"):
            continue   # attached: goes with its instance
        lab = d.get("labels") or {}
        out.resources.append(Resource(str(d.get("zone", "")).rsplit("/", 1)[-1], "disk",
                                      str(d.get("name", "")), lab.get(tags.CLUSTER, ""),
                                      lab.get(tags.OWNER, ""),
                                      str(d.get("creationTimestamp", ""))))
    for fw in network.find_rules(api, project, cluster, owner):
        m = tags.marks(fw.get("description"))
        out.resources.append(Resource("global", "firewall", str(fw["name"]),
                                      m.get(tags.CLUSTER, ""), m.get(tags.OWNER, ""),
                                      m.get("created-at", str(fw.get("creationTimestamp", "")))))
    for rp in compact.find(api, project, cluster, owner):
        m = tags.marks(rp.get("description"))
        out.resources.append(Resource(str(rp.get("region", "")).rsplit("/", 1)[-1],
                                      "resource-policy", str(rp["name"]), m.get(tags.CLUSTER, ""),
                                      m.get(tags.OWNER, ""), m.get("created-at", "")))
    for s in gpunics.find_subnetworks(api, project, cluster, owner):
        m = tags.marks(s.get("description"))
        out.resources.append(Resource(str(s.get("region", "")).rsplit("/", 1)[-1], "subnetwork",
                                      str(s["name"]), m.get(tags.CLUSTER, ""),
                                      m.get(tags.OWNER, ""), m.get("created-at", "")))
    for net in network.find_networks(api, project, cluster, owner):
        m = tags.marks(net.get("description"))
        out.resources.append(Resource("global", "network", str(net["name"]),
                                      m.get(tags.CLUSTER, ""), m.get(tags.OWNER, ""),
                                      m.get("created-at", str(net.get("creationTimestamp", "")))))
    return out


def teardown(api: Api, project: str, cluster: str, owner: str | None, *,
             sleep: Callable[[float], None], poll: float = 3.0, timeout: float = 900.0) -> None:
    """Remove everything marked for ``cluster`` (of ``owner``); return when GCE lists none
    of it."""
    insts = instances.describe(api, project, cluster, owner)
    if insts:
        by_zone: dict[str, list[str]] = defaultdict(list)
        for i in insts:
            by_zone[i.zone].append(i.name)
        instances.delete(api, project, dict(by_zone))
        deadline = time.monotonic() + timeout
        while instances.describe(api, project, cluster, owner):
            if time.monotonic() > deadline:
                break
            sleep(poll)
    found = find(api, project, cluster, owner)
    ops = []
    for r in found.of("disk"):
        try:
            ops.append((r, api.call("disks", "delete_unary", project=project, zone=r.region,
                                    disk=r.id)))
        except NotFound:
            continue
    for r, op in ops:
        try:
            api.wait(op, project=project, zone=r.region, what=f"deleting disk {r.id}")
        except NotFound:
            continue
    compact.delete(api, project, [(r.region, r.id) for r in found.of("resource-policy")])
    network.delete_rules(api, project, [r.id for r in found.of("firewall")])
    gpunics.delete_subnetworks(api, project, [(r.region, r.id) for r in found.of("subnetwork")])
    # the cluster's own network last: GCE refuses to delete one that rules or instances use
    network.delete_networks(api, project, [r.id for r in found.of("network")])
    left = find(api, project, cluster, owner).resources
    if left:
        raise ProviderError(
            f"after teardown, project {project} still lists: "
            + "; ".join(r.text() for r in left[:6])
            + ("" if len(left) <= 6 else f"; and {len(left) - 6} more") + ".",
            "Run 'cloudtrain down' again; if it persists, remove them in the GCP console.")


def group_by_cluster(resources: list[Resource]) -> dict[tuple[str, str], list[Resource]]:
    """(cluster, owner label) -> its resources."""
    out: dict[tuple[str, str], list[Resource]] = defaultdict(list)
    for r in resources:
        out[(r.cluster, r.owner)].append(r)
    return dict(out)
