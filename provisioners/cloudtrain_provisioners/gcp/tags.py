"""The marks cloudtrain puts on everything it creates in GCP, and finds it again by.

Instances and their boot disks carry three labels from the moment they exist (given in the
insert itself): ``cloudtrain-cluster`` (the cluster's name), ``cloudtrain-node-rank`` (the
node's rank) and ``cloudtrain-owner`` (who created it: user@host, in label characters).
GCE firewall rules have no labels: a rule's name is the cluster's base name plus its purpose,
and its description carries the same three marks (``cloudtrain-cluster=... cloudtrain-owner=...``),
which is how ``down`` and ``gc`` find rules without any local state.
"""

from __future__ import annotations

import hashlib
import re

from cloudtrain.provider import (check_name, default_owner, now, owner_hash,  # noqa: F401 - the door's marks, this cloud's tag names (tags.CLUSTER)
                                 split_owner)

CLUSTER = "cloudtrain-cluster"
RANK = "cloudtrain-node-rank"
OWNER = "cloudtrain-owner"
SHARED_RANK = "all"
DESCRIPTION_PREFIX = "cloudtrain firewall rule:"
_MARK = re.compile(r"(cloudtrain-[a-z-]+)=(\S*)")


def owner_value(owner: str) -> str:
    """``owner`` as a label value: lowercase letters, digits, '-' and '_', at most 63
    characters ('@' becomes '_at_', anything else '-'). The home id of ``user@host/home-<id>``
    is always kept whole at the end (``..._at_host-home-<id>``), so homes stay apart."""
    base, hid = split_owner(owner)
    if hid is None:
        return _label(owner, 63)
    suffix = f"-home-{hid}"
    return _label(base, 63 - len(suffix)) + suffix


def _label(text: str, limit: int) -> str:
    s = text.lower().replace("@", "_at_")
    s = re.sub(r"[^a-z0-9_-]", "-", s)
    if len(s) > limit:
        h = hashlib.sha256(text.encode()).hexdigest()[:8]
        s = s[:limit - 9] + "-" + h
    return s


def labels(cluster: str, owner: str, rank: int | str) -> dict[str, str]:
    return {CLUSTER: cluster, RANK: str(rank), OWNER: owner_value(owner)}


def instance_filter(cluster: str | None, owner: str | None) -> str:
    """A list filter for what belongs to ``cluster`` of ``owner`` (None: any cluster / any
    owner, but always something cloudtrain labelled)."""
    terms = [f"(labels.{CLUSTER}:*)"]
    if cluster is not None:
        terms.append(f'(labels.{CLUSTER} = "{_quoted(check_name(cluster))}")')
    if owner is not None:
        terms.append(f'(labels.{OWNER} = "{_quoted(owner_value(owner))}")')
    return " ".join(terms)


def _quoted(value: str) -> str:
    """``value`` inside a double-quoted filter string (label characters need no escape; a
    quote or backslash would end or bend the string)."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def base_name(cluster: str, owner: str) -> str:
    """The cluster's name prefix in GCE (instances ``<base>-<rank>``, firewall rules
    ``<base>-ssh`` ...) and its network tag: readable, and unique per owner (two people may
    both have a cluster called 'train'). At most 51 characters."""
    return f"ct-{check_name(cluster)}-{owner_hash(cluster, owner)}"


def description(cluster: str, owner: str, what: str) -> str:
    return (f"{DESCRIPTION_PREFIX} {what}. {CLUSTER}={cluster} {OWNER}={owner_value(owner)} "
            f"created-at={now()}")


def marks(description_text: str | None) -> dict[str, str]:
    """The marks in a firewall rule's description ({} when it is not cloudtrain's)."""
    text = description_text or ""
    if not text.startswith(DESCRIPTION_PREFIX):
        return {}
    found = dict(_MARK.findall(text))
    m = re.search(r"created-at=(\S+)", text)
    if m:
        found["created-at"] = m.group(1)
    return found if CLUSTER in found else {}
