"""Who created a cloud resource, and when: the marks every cloud provider puts on what it
creates so that ``up`` adopts, and ``down``/``gc`` find it, without any local state.

Clouds with free-form tags (AWS, Azure) use the keys below; GCP, whose labels allow no ':',
spells them with '-' (``cloudtrain-cluster`` ...)."""

from __future__ import annotations

import datetime as _dt
import getpass
import hashlib
import socket

CLUSTER = "cloudtrain:cluster"
RANK = "cloudtrain:node-rank"
OWNER = "cloudtrain:owner"
CREATED = "cloudtrain:created-at"
SHARED_RANK = "all"   # the rank mark on what the nodes share (network, keys, groups)


def default_owner() -> str:
    """user@host of this machine, at most 200 characters."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


def now() -> str:
    """UTC now, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_hash(cluster: str, owner: str) -> str:
    """6 hex digits that make a cluster's resource names unique per owner (two people may
    both have a cluster called 'train')."""
    return hashlib.sha256(f"{owner}\0{cluster}".encode()).hexdigest()[:6]
