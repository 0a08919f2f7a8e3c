"""Compact placement for a multi-node cluster on the fast network (A3): a resource policy
``<base>-place`` (``groupPlacementPolicy.collocation: COLLOCATED``) in the nodes' region,
named in every node's ``resourcePolicies``, so GCE puts the VMs close together. Marked in its
description like the cluster's networks and rules; deleted at teardown after the instances
(GCE refuses to delete a policy an instance uses)."""

from __future__ import annotations

from typing import Any

from . import tags
from .api import Api, Conflict, NotFound


def name(base: str) -> str:
    return f"{base}-place"


def path(project: str, region: str, base: str) -> str:
    return f"projects/{project}/regions/{region}/resourcePolicies/{name(base)}"


def ensure(api: Api, project: str, region: str, base: str, cluster: str, owner: str) -> str:
    """The cluster's compact placement policy in ``region`` (made once); its path."""
    try:
        api.get("resource_policies", "get", project=project, region=region,
                resource_policy=name(base))
        return path(project, region, base)
    except NotFound:
        pass
    body = {"name": name(base), "groupPlacementPolicy": {"collocation": "COLLOCATED"},
            "description": tags.description(cluster, owner, "compact placement of the nodes")}
    try:
        op = api.call("resource_policies", "insert_unary", project=project, region=region,
                      resource_policy_resource=api.clients.message("ResourcePolicy", body))
        api.wait(op, project=project, region=region, what=f"resource policy {name(base)}")
    except Conflict:
        pass
    return path(project, region, base)


def find(api: Api, project: str, cluster: str | None, owner: str | None) -> list[dict[str, Any]]:
    out = []
    for p in api.aggregated("resource_policies", project, "resource_policies", None):
        m = tags.marks(p.get("description"))
        if not m or not str(p.get("name", "")).startswith("ct-"):
            continue
        if cluster is not None and m.get(tags.CLUSTER) != cluster:
            continue
        if owner is not None and m.get(tags.OWNER) != tags.owner_value(owner):
            continue
        out.append(p)
    return out


def delete(api: Api, project: str, found: list[tuple[str, str]]) -> None:
    """Delete (region, name) policies; gone already is fine."""
    for region, policy in found:
        try:
            op = api.call("resource_policies", "delete_unary", project=project, region=region,
                          resource_policy=policy)
            api.wait(op, project=project, region=region, what=f"deleting policy {policy}")
        except NotFound:
            continue
