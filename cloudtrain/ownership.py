"""Who created a cloud resource, and when: the marks every cloud provider puts on what it
creates so that ``up`` adopts, and ``down``/``gc`` find it, without any local state.

Clouds with free-form tags (AWS, Azure) use the keys below; GCP, whose labels allow no ':',
spells them with '-' (``cloudtrain-cluster`` ...)."""

from __future__ import annotations

import datetime
import getpass
import hashlib
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any, Callable

CLUSTER = "cloudtrain:cluster"
RANK = "cloudtrain:node-rank"
OWNER = "cloudtrain:owner"
CREATED = "cloudtrain:created-at"
SHARED_RANK = "all"   # the rank mark on what the nodes share (network, keys, groups)


HOME_ID_FILE = "owner-id"
HOME_SEP = "/home-"          # owner = user@host/home-<id>
_HOME_ID = re.compile(r"\A[0-9a-f]{12}\Z")


def base_owner() -> str:
    """user@host of this machine, at most 200 characters (the whole owner mark of cloudtrain
    versions before the per-home id)."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


def home_id(home: Path) -> str:
    """This CLOUDTRAIN_HOME's id: 12 random hex digits, created once and kept in the home,
    so that two homes of one user@host (two projects, a CI runner) never take each other's
    clusters for their own."""
    f = Path(home) / HOME_ID_FILE
    try:
        value = f.read_text().strip()
    except FileNotFoundError:
        value = ""
    if _HOME_ID.match(value):
        return value
    Path(home).mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(6)
    tmp = f.with_name(f"{HOME_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(new + "\n")
    os.chmod(tmp, 0o600)
    try:
        os.link(tmp, f)          # first writer wins; a concurrent command reads its id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    value = f.read_text().strip()
    if not _HOME_ID.match(value):
        raise RuntimeError(f"{f} does not hold a home id; remove it and run again.")
    return value


def default_owner(home: Path | None = None) -> str:
    """The owner mark: ``user@host/home-<id>`` for the CLOUDTRAIN_HOME ``home`` (just
    user@host without one, as older versions wrote it)."""
    base = base_owner()
    return f"{base}{HOME_SEP}{home_id(home)}" if home is not None else base


def split_owner(owner: str) -> tuple[str, str | None]:
    """(user@host, home id or None for an owner written without one)."""
    base, sep, hid = owner.rpartition(HOME_SEP)
    if sep and _HOME_ID.match(hid):
        return base, hid
    return owner, None


def relation(mark: str, owner: str, as_mark: Callable[[str], str] = lambda o: o) -> str:
    """How a resource whose owner mark is ``mark`` relates to ``owner`` (this home's):
    ``mine``; ``other-home`` (same user@host, another CLOUDTRAIN_HOME); ``legacy`` (same
    user@host, written by a version without home ids: its home cannot be told); ``other``
    (another user or machine). ``as_mark`` spells an owner the way the cloud stores it (GCP
    labels)."""
    if mark == as_mark(owner):
        return "mine"
    base, _ = split_owner(owner)
    if mark == as_mark(base):
        return "legacy"
    cand = mark[-12:]
    if _HOME_ID.match(cand) and mark == as_mark(f"{base}{HOME_SEP}{cand}"):
        return "other-home"
    return "other"


def now() -> str:
    """UTC now, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_hash(cluster: str, owner: str) -> str:
    """6 hex digits that make a cluster's resource names unique per owner (two people may
    both have a cluster called 'train')."""
    return hashlib.sha256(f"{owner}\0{cluster}".encode()).hexdigest()[:6]


RECORD_MARK = "owner_has_home_id"   # in a provider's cluster record written by this version


def owner_of_cluster(record: dict[str, Any] | None, owner: str) -> str:
    """The owner mark of one cluster of this home: ``owner``, except for a cluster whose
    provider record was written by a version without home ids (its resources carry plain
    user@host; ``down`` and ``up`` must still find them)."""
    if record is not None and not record.get(RECORD_MARK):
        return split_owner(owner)[0]
    return owner
