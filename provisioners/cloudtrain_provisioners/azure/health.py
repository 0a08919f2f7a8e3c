"""What Azure says of each node of a cluster (``ReportsNodeHealth``), and clearing what a lost
node left so that ``create_nodes`` makes a fresh one in its rank.

Only ARM's answer counts: a VM whose instance view says PowerState/running (or starting, or
still being created) is running, even when SSH to it fails. Deallocated, stopped, deleting,
failed, or no VM for a rank is lost. A spot VM is made with eviction policy Delete, so an
eviction shows as the rank's VM gone (its NIC and public IP stay); a spot VM evicted with
policy Deallocate shows as PowerState/deallocated. An API error is unknown, not a loss.
"""

from __future__ import annotations

from typing import Any, Callable

from cloudtrain.errors import ProviderError, code_of
from cloudtrain.provider import NodeHealth

from . import instances, tags
from .api import Api

GONE = ("ResourceNotFound", "NotFound", "ResourceGroupNotFound")


def _lost_reason(v: instances.Vm) -> str:
    if v.state in ("Deleting", "Failed"):
        return f"VM {v.name} is {v.state.lower()}"
    power = v.power or "in an unknown power state"
    if v.spot and v.power == "deallocated":
        return f"VM {v.name} (spot) is deallocated: evicted by Azure, or deallocated"
    return f"VM {v.name} is {power}"


def judge(vms: list[instances.Vm], cluster: str, owner: str, ranks: int) -> list[NodeHealth]:
    mine = {v.rank: v for v in sorted(vms, key=lambda v: v.created_at)
            if v.rank is not None and v.cluster == cluster and v.owner == owner}
    out = []
    for rank in range(max([ranks, *(r + 1 for r in mine if r is not None)])):
        v = mine.get(rank)
        if v is None:
            out.append(NodeHealth(rank, "", "lost", "Azure lists no VM for this rank (deleted, "
                                                    "or a spot VM evicted: policy Delete)"))
        elif v.status in ("running", "pending"):
            out.append(NodeHealth(rank, v.id, "running"))
        else:
            out.append(NodeHealth(rank, v.id, "lost", _lost_reason(v)))
    return out


def node_health(api: Api, group: str, cluster: str, owner: str, ranks: int) -> list[NodeHealth]:
    try:
        vms = instances.list_vms(api, group)
    except ProviderError as exc:
        return [NodeHealth(r, "", "unknown", f"Azure could not be asked: {exc.message}")
                for r in range(ranks)]
    return judge(vms, cluster, owner, ranks)


def _delete_tagged(api: Api, what: str, getter: Callable[..., Any],
                   begin: Callable[..., Any], group: str,
                   name: str, cluster: str, rank: int) -> bool:
    """Delete ``name`` when it carries this cluster's tag and this rank; False when it is
    not there (or not ours: then it is left alone)."""
    try:
        res = api.call(f"read {what} {name}", getter, group, name)
    except ProviderError as exc:
        if code_of(exc) in GONE:
            return False
        raise
    marks = getattr(res, "tags", None) or {}
    if marks.get(tags.CLUSTER) != cluster or tags.rank_of(marks) != rank:
        return False
    try:
        api.lro(f"delete {what} {name}", begin, group, name)
    except ProviderError as exc:
        if code_of(exc) not in GONE:
            raise
    return True


def discard(api: Api, group: str, cluster: str, owner: str, ranks: list[int]) -> list[str]:
    """Delete the VM (its OS disk goes with it), then the NIC and public IP of each rank in
    ``ranks``, each only when tagged for this cluster and rank. Returns what was deleted."""
    vms = [v for v in instances.list_vms(api, group)
           if v.rank in set(ranks) and v.cluster == cluster and v.owner == owner]
    instances.delete_vms(api, group, [v.name for v in vms])
    done = [v.name for v in vms]
    net = api.c.network
    for rank in ranks:
        for what, getter, begin, name in (
                ("network interface", net.network_interfaces.get,
                 net.network_interfaces.begin_delete, tags.nic_name(cluster, rank)),
                ("public IP", net.public_ip_addresses.get, net.public_ip_addresses.begin_delete,
                 tags.ip_name(cluster, rank)),
                ("disk", api.c.compute.disks.get, api.c.compute.disks.begin_delete,
                 tags.disk_name(cluster, rank))):
            if _delete_tagged(api, what, getter, begin, group, name, cluster, rank):
                done.append(name)
    return done
