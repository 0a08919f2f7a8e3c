"""The nodes' own identity on AWS: an IAM role and instance profile per cluster, allowed on
exactly the task's S3 buckets (``ClusterRequest.buckets``), so a node reads and writes them
with credentials EC2's metadata service hands it, never the user's own keys.

What is created (only when the task names s3:// buckets and gives no
``resources.aws.iam_instance_profile`` of its own):

- role ``cloudtrain-<cluster>-<hash>`` under the path ``/cloudtrain/``, tagged like every
  other resource of the cluster (cluster, owner, rank ``all``, created-at), trusting
  ``ec2.amazonaws.com`` only;
- its inline policy ``cloudtrain-buckets``: ``s3:ListBucket`` on each bucket limited to the
  prefix (condition ``s3:prefix``), and Get/Put/AbortMultipartUpload/ListMultipartUploadParts
  on ``bucket/prefix/*`` (no Delete: uploads never delete);
- an instance profile of the same name, path and tags, holding the role; given to
  ``RunInstances`` as ``IamInstanceProfile``.

Found again by path + tags, never by a name alone: a role or profile of that name without
this cluster's tags is refused at ``up`` and never touched at ``down``/``gc``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable

from cloudtrain.errors import ProviderError, UserError, code_of
from cloudtrain.provider import BucketURL, buckets_of_scheme

from . import tags, teardown
from .api import Api

PATH = "/cloudtrain/"
POLICY = "cloudtrain-buckets"
WHERE = "IAM"
TRUST = {"Version": "2012-10-17",
         "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                        "Action": "sts:AssumeRole"}]}
OBJECT_ACTIONS = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload",
                  "s3:ListMultipartUploadParts"]


def s3_buckets(buckets: Iterable[BucketURL]) -> list[BucketURL]:
    """The task's buckets on S3 (one entry per bucket/prefix, in order)."""
    return buckets_of_scheme(buckets, "s3")


def foreign(buckets: Iterable[BucketURL]) -> list[BucketURL]:
    return [b for b in buckets if b.scheme != "s3"]


def policy_document(buckets: list[BucketURL]) -> dict[str, Any]:
    """The inline policy: list each bucket under its prefix, read/write objects there."""
    statements: list[dict[str, Any]] = []
    for b in buckets:
        arn = f"arn:aws:s3:::{b.bucket}"
        listing: dict[str, Any] = {"Effect": "Allow",
                                   "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
                                   "Resource": arn}
        if b.prefix:
            listing["Condition"] = {"StringLike": {"s3:prefix": [b.prefix, f"{b.prefix}/*"]}}
        statements.append(listing)
        objects = f"{arn}/{b.prefix}/*" if b.prefix else f"{arn}/*"
        statements.append({"Effect": "Allow", "Action": list(OBJECT_ACTIONS),
                           "Resource": objects})
    return {"Version": "2012-10-17", "Statement": statements}


def plan(buckets: Iterable[BucketURL], base: str, own: str | None
         ) -> tuple[list[str], list[str]]:
    """(creates, notes) for the nodes' identity."""
    s3, other = s3_buckets(buckets), foreign(buckets)
    creates: list[str] = []
    notes: list[str] = []
    names = ", ".join(str(b) for b in s3)
    if s3 and own:
        notes.append(f"the nodes use your instance profile {own} for {names}")
    elif s3:
        creates.append(f"IAM role and instance profile {base} (path {PATH}, trusted "
                       f"by EC2 only): list, read and write objects (no delete) in {names}")
    if other:
        notes.append("the nodes get no AWS identity for " + ", ".join(str(b) for b in other)
                     + ": give them credentials for those in the task's envs")
    return creates, notes


@dataclass(frozen=True)
class Found:
    kind: str          # role | instance-profile
    name: str
    cluster: str
    owner: str
    created_at: str


def _marks(tag_list: list[dict[str, str]] | None) -> dict[str, str]:
    return tags.as_dict(tag_list)


def _profile_marks(iam: Api, name: str) -> dict[str, str]:
    """An instance profile's tags: listings leave them out, GetInstanceProfile gives them."""
    prof = iam.call(WHERE, "get_instance_profile", InstanceProfileName=name)["InstanceProfile"]
    return _marks(prof.get("Tags"))


def _ours(marks: dict[str, str], cluster: str | None, owner: str | None) -> bool:
    if tags.CLUSTER not in marks:
        return False
    if cluster is not None and marks.get(tags.CLUSTER) != cluster:
        return False
    return owner is None or marks.get(tags.OWNER) == owner


def resources(found: list[Found]) -> list[teardown.Resource]:
    """As gc lists resources (region ``IAM``: IAM is global)."""
    return [teardown.Resource(WHERE, f.kind, f.name, f.cluster, f.owner, f.created_at, f.name)
            for f in found]


def found_of(res: list[teardown.Resource]) -> list[Found]:
    return [Found(r.kind, r.name, r.cluster, r.owner, r.created_at) for r in res]


def find(iam: Api, cluster: str | None, owner: str | None) -> list[Found]:
    """Roles and instance profiles under ``/cloudtrain/`` tagged for ``cluster`` of ``owner``
    (None: any), roles first."""
    out: list[Found] = []
    for role in iam.pages(WHERE, "list_roles", "Roles", PathPrefix=PATH):
        marks = _marks(iam.call(WHERE, "list_role_tags", RoleName=role["RoleName"]).get("Tags"))
        if _ours(marks, cluster, owner):
            out.append(Found("role", role["RoleName"], marks[tags.CLUSTER],
                             marks.get(tags.OWNER, ""), marks.get(tags.CREATED, "")))
    for prof in iam.pages(WHERE, "list_instance_profiles", "InstanceProfiles", PathPrefix=PATH):
        marks = _profile_marks(iam, prof["InstanceProfileName"])
        if _ours(marks, cluster, owner):
            out.append(Found("instance-profile", prof["InstanceProfileName"],
                             marks[tags.CLUSTER], marks.get(tags.OWNER, ""),
                             marks.get(tags.CREATED, "")))
    return out


def _not_ours(kind: str, name: str) -> UserError:
    return UserError(f"An IAM {kind} named '{name}' exists but is not tagged for this cluster; "
                     "cloudtrain does not touch it.",
                     "Rename the cluster, or give your own profile in "
                     "resources.aws.iam_instance_profile.")


def _create(iam: Api, op: str, **params: Any) -> bool:
    """Create one thing; False when it exists already."""
    try:
        iam.call(WHERE, op, **params)
        return True
    except ProviderError as exc:
        if code_of(exc) == "EntityAlreadyExists":
            return False
        raise


def ensure(iam: Api, cluster: str, owner: str, buckets: list[BucketURL]) -> str:
    """Create (or adopt, when tagged for this cluster) the role and instance profile; set the
    inline policy to exactly ``buckets``. Returns the instance profile's name."""
    name = tags.base_name(cluster, owner)
    marks = tags.tag_list(cluster, owner, tags.SHARED_RANK)
    if not _create(iam, "create_role", RoleName=name, Path=PATH, Tags=marks,
                   AssumeRolePolicyDocument=json.dumps(TRUST),
                   Description=f"cloudtrain cluster {cluster}: S3 access of its nodes"):
        got = _marks(iam.call(WHERE, "list_role_tags", RoleName=name).get("Tags"))
        if not _ours(got, cluster, owner):
            raise _not_ours("role", name)
    iam.call(WHERE, "put_role_policy", RoleName=name, PolicyName=POLICY,
             PolicyDocument=json.dumps(policy_document(buckets)))
    if not _create(iam, "create_instance_profile", InstanceProfileName=name, Path=PATH,
                   Tags=marks):
        got = _profile_marks(iam, name)
        if not _ours(got, cluster, owner):
            raise _not_ours("instance profile", name)
    prof = iam.call(WHERE, "get_instance_profile", InstanceProfileName=name)["InstanceProfile"]
    if not any(r["RoleName"] == name for r in prof.get("Roles", [])):
        iam.call(WHERE, "add_role_to_instance_profile", InstanceProfileName=name, RoleName=name)
    return name


def _gone(iam: Api, op: str, **params: Any) -> None:
    try:
        iam.call(WHERE, op, **params)
    except ProviderError as exc:
        if code_of(exc) != "NoSuchEntity":
            raise


def remove(iam: Api, found: list[Found]) -> None:
    """Remove what :func:`find` found: each profile emptied and deleted, each role's inline
    policies and attachments removed, then the role."""
    for f in found:
        if f.kind != "instance-profile":
            continue
        try:
            prof = iam.call(WHERE, "get_instance_profile",
                            InstanceProfileName=f.name)["InstanceProfile"]
        except ProviderError as exc:
            if code_of(exc) == "NoSuchEntity":
                continue
            raise
        for role in prof.get("Roles", []):
            _gone(iam, "remove_role_from_instance_profile", InstanceProfileName=f.name,
                  RoleName=role["RoleName"])
        _gone(iam, "delete_instance_profile", InstanceProfileName=f.name)
    for f in found:
        if f.kind != "role":
            continue
        try:
            names = list(iam.pages(WHERE, "list_role_policies", "PolicyNames", RoleName=f.name))
            attached = list(iam.pages(WHERE, "list_attached_role_policies", "AttachedPolicies",
                                      RoleName=f.name))
            profiles = list(iam.pages(WHERE, "list_instance_profiles_for_role",
                                      "InstanceProfiles", RoleName=f.name))
        except ProviderError as exc:
            if code_of(exc) == "NoSuchEntity":
                continue
            raise
        for p in profiles:   # a profile of ours that holds it, left by a half-done remove
            _gone(iam, "remove_role_from_instance_profile",
                  InstanceProfileName=p["InstanceProfileName"], RoleName=f.name)
        for policy in names:
            _gone(iam, "delete_role_policy", RoleName=f.name, PolicyName=policy)
        for a in attached:
            _gone(iam, "detach_role_policy", RoleName=f.name, PolicyArn=a["PolicyArn"])
        _gone(iam, "delete_role", RoleName=f.name)


def teardown_cluster(iam: Api, cluster: str, owner: str | None) -> None:
    """Remove the cluster's role and profile (found by path and tags); check none is left."""
    remove(iam, find(iam, cluster, owner))
    left = find(iam, cluster, owner)
    if left:
        raise ProviderError("after teardown, IAM still lists: "
                            + ", ".join(f"{f.kind} {f.name}" for f in left) + ".",
                            "Run 'cloudtrain down' again; if it persists, remove them in the "
                            "IAM console (path /cloudtrain/).")
