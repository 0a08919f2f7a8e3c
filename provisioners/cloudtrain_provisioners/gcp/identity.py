"""The nodes' own identity on GCP: a service account per cluster, allowed on exactly the task's
gs:// buckets (``ClusterRequest.buckets``), attached to the instances, so a node reads and
writes them with tokens from the metadata server, never the user's keys.

What is created (only when the task names gs:// buckets and gives no
``resources.gcp.service_account`` of its own):

- service account ``ct-<cluster>-<hash>@PROJECT.iam.gserviceaccount.com`` (IAM API
  ``projects.serviceAccounts.create``). Service accounts take no labels, so the account id
  is derived from the cluster and owner, and the description carries the same marks as the
  cluster's firewall rules (``cloudtrain-cluster=... cloudtrain-owner=...``): it is found
  again by those marks, never by the name alone;
- on each bucket, a binding of ``roles/storage.objectAdmin`` for it (Cloud Storage
  ``getIamPolicy``/``setIamPolicy``, policy version 3). With a prefix, the binding has a
  condition: objects under ``prefix/`` and the bucket itself (listing); conditions need
  uniform bucket-level access on the bucket, as GCS requires.

The instances get it with the ``cloud-platform`` scope (its roles are what limit it).
``down`` removes the account from each recorded bucket's policy, then deletes it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from cloudtrain.errors import ProviderError, UserError
from cloudtrain.provider import BucketURL, buckets_of_scheme, now, owner_hash

from . import tags
from .api import Api, Conflict, NotFound

ROLE = "roles/storage.objectAdmin"
PREFIX = "cloudtrain service account of a cluster's nodes (bucket access):"
_MARK = re.compile(r"(cloudtrain-[a-z-]+)=(\S*)")


def gcs_buckets(buckets: Iterable[BucketURL]) -> list[BucketURL]:
    return buckets_of_scheme(buckets, "gs")


def account_id(cluster: str, owner: str) -> str:
    """6-30 characters: lowercase letters, digits, hyphens; unique per cluster and owner."""
    h = owner_hash(cluster, owner)
    room = 30 - len("ct--") - len(h)
    part = re.sub(r"[^a-z0-9-]+", "-", cluster.lower())[:room].strip("-") or "x"
    return f"ct-{part}-{h}"


def email_of(cluster: str, owner: str, project: str) -> str:
    return f"{account_id(cluster, owner)}@{project}.iam.gserviceaccount.com"


def plan(buckets: Iterable[BucketURL], email: str, own: str | None
         ) -> tuple[list[str], list[str]]:
    found = list(buckets)
    gs, other = gcs_buckets(found), [str(b) for b in found if b.scheme != "gs"]
    creates: list[str] = []
    notes: list[str] = []
    names = ", ".join(str(b) for b in gs)
    if gs and own:
        notes.append(f"the nodes use your service account {own} for {names}")
    elif gs:
        creates.append(f"service account {email} for the nodes: {ROLE} on {names} only "
                       "(a prefix: an IAM condition on it)")
    if other:
        notes.append("the nodes get no GCP identity for " + ", ".join(other)
                     + ": give them credentials for those in the task's envs")
    return creates, notes


def description(cluster: str, owner: str) -> str:
    return (f"{PREFIX} {tags.CLUSTER}={cluster} {tags.OWNER}={tags.owner_value(owner)} "
            f"created-at={now()}")


def marks(sa: dict[str, Any]) -> dict[str, str]:
    """The marks in a service account's description ({} when it is not cloudtrain's)."""
    text = str(sa.get("description") or "")
    if not text.startswith(PREFIX):
        return {}
    found = dict(_MARK.findall(text))
    return found if tags.CLUSTER in found else {}


def _ours(sa: dict[str, Any], cluster: str | None, mark: str | None) -> bool:
    """``mark``: the owner as GCE labels hold it (:func:`tags.owner_value`); None: any."""
    found = marks(sa)
    if not found:
        return False
    if cluster is not None and found.get(tags.CLUSTER) != cluster:
        return False
    return mark is None or found.get(tags.OWNER) == mark


def find(api: Api, project: str, cluster: str | None, mark: str | None) -> list[dict[str, Any]]:
    """The project's service accounts whose description marks them as ``cluster``'s (None:
    any cluster) of the owner ``mark`` (None: any)."""
    out, token = [], None
    while True:
        page = api.rest("iam", "GET", f"/v1/projects/{project}/serviceAccounts",
                        params={"pageToken": token} if token else None)
        out += [sa for sa in page.get("accounts") or [] if _ours(sa, cluster, mark)]
        token = page.get("nextPageToken")
        if not token:
            return out


def _condition(b: BucketURL, cluster: str) -> dict[str, str] | None:
    if not b.prefix:
        return None
    return {"title": f"cloudtrain {cluster}"[:100],
            "description": f"objects under {b.prefix}/ and listing the bucket",
            "expression": f'resource.name.startsWith("projects/_/buckets/{b.bucket}/objects/'
                          f'{b.prefix}/") || resource.type == "storage.googleapis.com/Bucket"'}


def _policy(api: Api, bucket: str) -> dict[str, Any]:
    return api.rest("storage", "GET", f"/storage/v1/b/{bucket}/iam",
                    params={"optionsRequestedPolicyVersion": "3"})


def _set_policy(api: Api, bucket: str, policy: dict[str, Any]) -> None:
    policy["version"] = 3
    api.rest("storage", "PUT", f"/storage/v1/b/{bucket}/iam", body=policy)


def grant(api: Api, b: BucketURL, member: str, cluster: str) -> None:
    """Add the binding (exactly once) to the bucket's policy."""
    for attempt in range(5):
        policy = _policy(api, b.bucket)
        bindings = policy.setdefault("bindings", [])
        want: dict[str, Any] = {"role": ROLE, "members": [member]}
        cond = _condition(b, cluster)
        if cond:
            want["condition"] = cond
        if any(x.get("role") == ROLE and member in x.get("members", []) and
               x.get("condition") == want.get("condition") for x in bindings):
            return
        bindings.append(want)
        try:
            _set_policy(api, b.bucket, policy)
            return
        except ProviderError as exc:   # 412: someone changed it since we read it
            if "412" not in (exc.code or "") and "conditionNotMet" not in (exc.code or "") \
                    or attempt == 4:
                raise


def revoke(api: Api, bucket: str, member: str) -> None:
    """Remove ``member`` from every binding of the bucket's policy."""
    try:
        policy = _policy(api, bucket)
    except NotFound:
        return
    bindings = policy.get("bindings", [])
    if not any(member in x.get("members", []) for x in bindings):
        return
    kept = []
    for x in bindings:
        members = [m for m in x.get("members", []) if m != member]
        if members:
            kept.append({**x, "members": members})
    policy["bindings"] = kept
    _set_policy(api, bucket, policy)


def ensure(api: Api, project: str, cluster: str, owner: str,
           buckets: list[BucketURL]) -> str:
    """Create (or adopt, when its description marks it as this cluster's) the service
    account, and bind it on each bucket. Returns its email."""
    aid = account_id(cluster, owner)
    email = f"{aid}@{project}.iam.gserviceaccount.com"
    try:
        sa = api.rest("iam", "POST", f"/v1/projects/{project}/serviceAccounts", body={
            "accountId": aid, "serviceAccount": {
                "displayName": f"cloudtrain {cluster}"[:100],
                "description": description(cluster, owner)}})
        email = str(sa.get("email") or email)
    except Conflict:
        sa = api.rest("iam", "GET", f"/v1/projects/{project}/serviceAccounts/{email}")
        if not _ours(sa, cluster, tags.owner_value(owner)):
            raise UserError(f"A service account {email} exists but is not marked as this "
                            "cluster's; cloudtrain does not touch it.",
                            "Rename the cluster, or give your own in "
                            "resources.gcp.service_account.") from None
    for b in buckets:
        grant(api, b, f"serviceAccount:{email}", cluster)
    return email


def teardown(api: Api, project: str, cluster: str, mark: str | None,
             buckets: list[str]) -> None:
    """Remove the cluster's accounts (found by their marks; ``mark``: the owner's) from
    ``buckets``' policies and delete them."""
    for sa in find(api, project, cluster, mark):
        remove(api, project, sa, buckets)


def remove(api: Api, project: str, sa: dict[str, Any], buckets: list[str]) -> None:
    email = str(sa.get("email"))
    for bucket in buckets:
        revoke(api, bucket, f"serviceAccount:{email}")
    try:
        api.rest("iam", "DELETE", f"/v1/projects/{project}/serviceAccounts/{email}")
    except NotFound:
        pass
