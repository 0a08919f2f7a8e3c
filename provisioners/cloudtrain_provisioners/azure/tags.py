"""The tags cloudtrain puts on everything it creates in Azure, and the names it gives.

Every resource carries ``cloudtrain:cluster`` (the cluster's name), ``cloudtrain:node-rank``
(the node's rank; ``all`` on what the nodes share: resource group, VNet, NSG),
``cloudtrain:owner`` (user@host) and ``cloudtrain:created-at`` (UTC, ISO 8601), given in the
create call itself. The one exception is a VM's OS disk, which Azure creates with the VM
without tags: cloudtrain tags it right after.

Names are derived from the cluster and owner, so a PUT repeated after a crash updates what
exists instead of creating a second one.
"""

from __future__ import annotations

from cloudtrain.provider import (CLUSTER, CREATED, OWNER, RANK, SHARED_RANK,  # noqa: F401 - the door's marks, this cloud's tag names (tags.CLUSTER)
                                 check_name, default_owner, now, owner_hash)

REGION = "cloudtrain:region"
GUARD_STOP = "cloudtrain:guard-stop"
"""Left on a VM by its node guard just before the VM deallocates itself: "<reason> <epoch>"."""


def tags(cluster: str, owner: str, rank: int | str, created: str | None = None) -> dict[str, str]:
    return {CLUSTER: cluster, RANK: str(rank), OWNER: owner, CREATED: created or now()}


def _h(cluster: str, owner: str) -> str:
    return owner_hash(cluster, owner)


def group_name(cluster: str, owner: str) -> str:
    """The cluster's resource group: readable, unique per owner (two people may both have a
    cluster called 'train' in one subscription)."""
    return f"cloudtrain-{check_name(cluster)}-{_h(cluster, owner)}"


VNET = "ct-vnet"
SUBNET = "ct-nodes"
NSG = "ct-nsg"


def vm_name(cluster: str, rank: int) -> str:
    """Also the node's host name (Linux allows 64 characters; cluster names have 40)."""
    return f"{cluster}-{rank}"


def nic_name(cluster: str, rank: int) -> str:
    return f"{vm_name(cluster, rank)}-nic"


def ip_name(cluster: str, rank: int) -> str:
    return f"{vm_name(cluster, rank)}-ip"


def disk_name(cluster: str, rank: int) -> str:
    return f"{vm_name(cluster, rank)}-osdisk"


def rank_of(tag_map: dict[str, str] | None) -> int | None:
    try:
        return int((tag_map or {}).get(RANK, ""))
    except ValueError:
        return None
