"""The nodes' own identity for the task's Azure Blob containers (``ClusterRequest.buckets``).

Each VM has a system-assigned managed identity (the node guard's self-stop already asks for
one; with ``resources.azure.self_stop: false`` it is still made when the task names az
containers). ``up`` gives that identity the built-in **Storage Blob Data Contributor** role
on each named container's own scope
(``/subscriptions/S/resourceGroups/RG/providers/Microsoft.Storage/storageAccounts/A/
blobServices/default/containers/C``), the account's group found by listing the
subscription's storage accounts; a node reads and writes there with tokens from IMDS, never
the user's keys. The role covers the whole container: Azure RBAC has no prefix scope (an ABAC
condition on the path would need a custom assignment condition; not used).

Role assignments carry no tags and outlive the identity they name (deleting a VM leaves them
as "identity not found"), so each carries a description with the cluster's and owner's marks
and the scopes are recorded (the cluster's ``azure.json``, before anything is granted);
``down`` deletes, at each recorded scope, only the assignments with this cluster's mark.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from cloudtrain.errors import ProviderError, UserError, code_of
from cloudtrain.provider import BucketURL

from .api import AUTHZ_API, Api, RoleAssignment, assign_role

ROLE = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
ROLE_NAME = "Storage Blob Data Contributor"
STORAGE_API = "2023-01-01"


def containers(buckets: Iterable[BucketURL]) -> list[BucketURL]:
    """The task's containers on Azure itself (Azurite, with an endpoint, has no ARM)."""
    out: list[BucketURL] = []
    for b in buckets:
        if b.scheme == "az" and not b.endpoint and (b.account, b.bucket) not in [
                (o.account, o.bucket) for o in out]:
            out.append(b)
    return out


def plan(buckets: Iterable[BucketURL], group: str) -> tuple[list[str], list[str]]:
    """(creates, notes) for ``--dry-run``."""
    found = list(buckets)
    mine = containers(found)
    creates = [f"per VM: its managed identity gets {ROLE_NAME} on container {b.account}/"
               f"{b.bucket} only ({b}; the whole container: Azure roles have no prefix scope)"
               for b in mine]
    other = [str(b) for b in found if b.scheme != "az" or b.endpoint]
    notes = ["the nodes get no Azure identity for " + ", ".join(other)
             + ": give them credentials for those in the task's envs"] if other else []
    return creates, notes


def mark(cluster: str, owner: str) -> str:
    return f"cloudtrain:cluster={cluster} cloudtrain:owner={owner}"


def scopes(api: Api, buckets: list[BucketURL]) -> list[str]:
    """Each container's scope; a storage account the subscription does not hold is refused
    (nothing granted yet). No containers: no call."""
    if not buckets:
        return []
    got = api.rest("list storage accounts", "GET",
                   f"/subscriptions/{api.subscription_id}/providers/Microsoft.Storage/"
                   f"storageAccounts?api-version={STORAGE_API}") or {}
    ids = {str(a.get("name", "")).lower(): str(a.get("id", "")) for a in got.get("value") or []}
    out = []
    for b in buckets:
        aid = ids.get(b.account.lower())
        if not aid:
            raise UserError(f"Storage account '{b.account}' (of {b}) is not in subscription "
                            f"{api.subscription_id}, so its nodes cannot be given a role on it.",
                            "Use a container of this subscription, or give the nodes "
                            "credentials for it in the task's envs (e.g. a SAS URL).")
        out.append(f"{aid}/blobServices/default/containers/{b.bucket}")
    return out


def grant(api: Api, vms: list[Any], where: list[str], note: str,
          sleep: Callable[[float], None], tries: int = 12) -> None:
    """The role at each scope for each VM's identity (one assignment each, named from the
    principal, role and scope, so a repeated ``up`` writes the same one)."""
    for vm in vms:
        if not vm.principal:
            raise ProviderError(f"VM {vm.name} has no managed identity.",
                                "Run 'cloudtrain down' and 'up' again.")
        for scope in where:
            assign_role(api, RoleAssignment(vm.principal, ROLE, scope, note),
                        f"give VM {vm.name}'s identity {ROLE_NAME} on {scope}",
                        sleep=sleep, tries=tries)


def revoke(api: Api, where: list[str], note: str) -> int:
    """Delete the assignments at each scope whose description is ``note``; returns how many."""
    done = 0
    for scope in where:
        try:
            got = api.rest(f"list role assignments on {scope}", "GET",
                           f"{scope}/providers/Microsoft.Authorization/roleAssignments"
                           f"?api-version={AUTHZ_API}&$filter=atScope()") or {}
        except ProviderError as exc:
            if code_of(exc) in ("ResourceNotFound", "ResourceGroupNotFound", "NotFound"):
                continue
            raise
        for a in got.get("value") or []:
            props = a.get("properties") or {}
            if props.get("description") != note or \
                    str(props.get("scope", "")).lower() != scope.lower():
                continue
            try:
                api.rest("delete a role assignment", "DELETE",
                         f"{a['id']}?api-version={AUTHZ_API}")
                done += 1
            except ProviderError as exc:
                if code_of(exc) not in ("RoleAssignmentNotFound", "NotFound"):
                    raise
    return done


def ensure(api: Api, vms: list[Any], buckets: Iterable[BucketURL], cluster: str, owner: str,
           remember: Callable[[list[str]], None], known: list[str],
           sleep: Callable[[float], None]) -> None:
    """Scopes found and recorded (with the ones recorded before), then granted."""
    mine = containers(buckets)
    if not mine:
        return
    where = scopes(api, mine)
    remember(sorted(set(known) | set(where)))
    grant(api, vms, where, mark(cluster, owner), sleep)
