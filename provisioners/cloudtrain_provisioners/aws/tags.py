"""The tags cloudtrain puts on everything it creates in AWS, and finds it again by.

Every resource carries four tags from the moment it exists (they are given in the create call
itself, never added afterwards): ``cloudtrain:cluster`` (the cluster's name),
``cloudtrain:node-rank`` (the node's rank; ``all`` on what the nodes share: security group,
key pair, placement group), ``cloudtrain:owner`` (who created it: user@host) and
``cloudtrain:created-at`` (UTC, ISO 8601). ``up`` adopts and ``down``/``gc`` remove by the
cluster and owner tags, so nothing depends on local state.
"""

from __future__ import annotations

from typing import Any

from cloudtrain.provider import (CLUSTER, CREATED, OWNER, RANK, SHARED_RANK,  # noqa: F401 - the door's marks, this cloud's tag names (tags.CLUSTER)
                                 check_name, default_owner, now, owner_hash)


def tag_list(cluster: str, owner: str, rank: int | str, created: str | None = None
             ) -> list[dict[str, str]]:
    return [{"Key": CLUSTER, "Value": cluster}, {"Key": RANK, "Value": str(rank)},
            {"Key": OWNER, "Value": owner}, {"Key": CREATED, "Value": created or now()}]


def spec(resource_types: list[str], tags: list[dict[str, str]]) -> list[dict[str, Any]]:
    """``TagSpecifications`` tagging each of ``resource_types`` at creation."""
    return [{"ResourceType": t, "Tags": list(tags)} for t in resource_types]


def filters(cluster: str | None, owner: str | None) -> list[dict[str, Any]]:
    """Describe filters for what belongs to ``cluster`` of ``owner`` (None: any cluster /
    any owner, but always something cloudtrain tagged)."""
    out: list[dict[str, Any]] = [{"Name": "tag-key", "Values": [CLUSTER]}]
    if cluster is not None:
        out.append({"Name": f"tag:{CLUSTER}", "Values": [escape(check_name(cluster))]})
    if owner is not None:
        out.append({"Name": f"tag:{OWNER}", "Values": [escape(owner)]})
    return out


def escape(value: str) -> str:
    """An EC2 filter value that matches ``value`` literally: EC2 reads '*' and '?' as
    wildcards, escaped with a backslash (which is escaped too)."""
    return value.replace("\\", "\\\\").replace("*", "\\*").replace("?", "\\?")


def as_dict(tags: list[dict[str, str]] | None) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in tags or []}


def base_name(cluster: str, owner: str) -> str:
    """The name of the cluster's security group, key pair and placement group: readable,
    and unique per owner (two people may both have a cluster called 'train')."""
    return f"cloudtrain-{check_name(cluster)}-{owner_hash(cluster, owner)}"
