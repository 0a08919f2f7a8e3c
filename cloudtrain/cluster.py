"""The cluster record: its name, its lock, the handle every step works with (state row,
provider, keys), connecting to its nodes, and its status as the state and the providers
see it. Provisioning, bootstrapping, running and tearing down live in ``cloudtrain.pipeline``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from cloudtrain.context import Env
from cloudtrain.errors import ClusterNotFound, UserError
from cloudtrain.schema import ClusterRow, NodeRow

if TYPE_CHECKING:       # imported where used: a plain 'status' loads none of them
    from cloudtrain.keys import ClusterKeys
    from cloudtrain.provider.contract import Node, Provider
    from cloudtrain.remote import Group
    from cloudtrain.taskmodel import Task

SSH_TIMEOUT = float(os.environ.get("CLOUDTRAIN_SSH_TIMEOUT", "300"))


@dataclass
class Handle:
    row: ClusterRow
    provider: Provider
    keys: ClusterKeys
    learn: frozenset[int] = frozenset()
    """Ranks whose host key may be learned on first contact (new nodes with none reported)."""

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def nodes(self) -> list[NodeRow]:
        return self.row.nodes

    @property
    def head(self) -> NodeRow:
        return self.row.nodes[0]


CLUSTER_ID_VAR = "CLOUDTRAIN_CLUSTER_ID"
"""The variable every process cloudtrain starts on a node carries, set to :func:`cluster_uid`:
how ``down`` finds them (bootstrap/ctguard.sh sets it too)."""


def cluster_uid(env: Env, name: str) -> str:
    """Unique across CLOUDTRAIN_HOMEs on one machine: marks the processes of this cluster."""
    return hashlib.sha256(f"{env.home.resolve()}:{name}".encode()).hexdigest()[:12]


def cluster_mark(env: Env, name: str) -> str:
    """``CLOUDTRAIN_CLUSTER_ID=<uid>``: the cluster's mark in a node process's environment."""
    return f"{CLUSTER_ID_VAR}={cluster_uid(env, name)}"


def resolve_name(task: Task, override: str | None, task_path: str | None) -> str:
    from cloudtrain.names import check

    name = override or task.cluster_name   # 'name: My_Job' -> my-job (names.derive)
    if not name and task_path:
        stem = Path(task_path).stem.lower().replace("_", "-")
        name = "".join(c for c in stem if c.isalnum() or c == "-").strip("-") or None
    if not name:
        raise UserError("The cluster has no name.", "Give one with -c NAME or 'name:' in the task.")
    return check(name, "-c/--cluster" if override else "cluster name")


@contextmanager
def cluster_lock(env: Env, name: str) -> Iterator[None]:
    from cloudtrain.names import check, inside

    d = env.home / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(inside(d, f"{check(name)}.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            env.ui.info(f"Waiting for another cloudtrain command working on '{name}'...")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def node_rows(cluster: str, nodes: list[Node]) -> list[NodeRow]:
    return [NodeRow(cluster=cluster, rank=n.rank, instance_id=n.instance_id, host=n.host,
                    port=n.port, user=n.user, internal_ip=n.cluster_ip, status=n.status,
                    root_dir=n.root_dir, identity_file=n.identity_file)
            for n in sorted(nodes, key=lambda n: n.rank)]


def refuse_scheduled(handle: Handle) -> None:
    """A scheduler's nodes (Slurm) are never SSHed to: UserError (exit 2) for a command that
    would."""
    from cloudtrain.provider.contract import Allocates

    if isinstance(handle.provider, Allocates):
        raise UserError(f"the nodes of '{handle.name}' ({handle.row.provider}) are reached "
                        "through the scheduler, not over SSH: this command is not built for "
                        "them yet.", "docs/slurm.md lists what works on Slurm now.")


def connect(env: Env, handle: Handle, timeout: float = SSH_TIMEOUT,
            nodes: list[NodeRow] | None = None) -> Group:
    """SSH to the cluster's nodes (``nodes``: only those, e.g. the head alone), the host
    keys learned as the handle says; nothing is left open when one cannot be reached."""
    from cloudtrain.remote import Group

    refuse_scheduled(handle)
    group = Group(handle.nodes if nodes is None else nodes, handle.keys)
    try:
        group.connect(timeout=timeout, learn=handle.learn)
    except BaseException:
        group.close()
        raise
    return group


def get_handle(env: Env, name: str) -> Handle:
    row = env.state.get_cluster(name)
    if row is None:
        raise ClusterNotFound(name, [c.name for c in env.state.list_clusters()])
    from cloudtrain.keys import ClusterKeys

    provider = env.provider(row.provider)
    keys = ClusterKeys(env.pctx.cluster_dir(name) / "ssh")
    return Handle(row, provider, keys)


def lost_record_hint(exc: ClusterNotFound, name: str) -> ClusterNotFound:
    """Add to 'no such cluster' that a cluster whose local record was lost is found by tag."""
    exc.hint += (f" If it exists but this CLOUDTRAIN_HOME lost its record (state deleted, "
                 f"another machine), 'cloudtrain down {name} --provider PROVIDER' finds it by "
                 "its tag (PROVIDER: aws, gcp, azure, local).")
    return exc


def refresh(env: Env, row: ClusterRow) -> ClusterRow:
    """Ask the provider what exists now and update the cached node statuses."""
    provider = env.provider(row.provider)
    live = {n.rank: n for n in provider.list_nodes(row.name)}
    for n in row.nodes:
        found = live.get(n.rank)
        n.status = found.status if found is not None and found.instance_id == n.instance_id \
            else "terminated"
    if row.nodes:
        env.state.replace_nodes(row.name, row.nodes)
    if row.status == "UP" and any(n.status != "running" for n in row.nodes):
        row.status = "DEGRADED"
    return row


def listed(env: Env, name: str | None = None) -> list[ClusterRow]:
    """The clusters in the state (or ``name``, which must be there), as last recorded."""
    rows = env.state.list_clusters()
    if name is not None:
        rows = [r for r in rows if r.name == name]
        if not rows:
            raise ClusterNotFound(name, [c.name for c in env.state.list_clusters()])
    return rows


def status(env: Env, name: str | None = None, refresh_all: bool = False) -> list[ClusterRow]:
    """The clusters, each refreshed from its provider where listing is cheap (every one
    with ``refresh_all``)."""
    out = []
    for row in listed(env, name):
        cls = env.provider_class(row.provider)
        if refresh_all or cls.list_is_cheap:
            try:
                row = refresh(env, row)
            except Exception as exc:  # noqa: BLE001 - status must still show the rest
                env.ui.warn(f"could not refresh '{row.name}' from {row.provider}: {exc}")
        out.append(row)
    return out


PROBE_TIMEOUT = 5.0


def probe_hosts(env: Env, rows: list[ClusterRow]) -> None:
    """Nodes of providers that never power anything off (the ``ssh`` provider: the user's own
    machines, with no API to ask) are checked live: does each answer with an SSH banner within
    PROBE_TIMEOUT s (through the cluster's ``resources.ssh_proxy`` when it has one)? All at
    once, so the wait is bounded whatever the number of hosts. A node that does not is shown
    as 'unreachable' and its cluster as DEGRADED (UNREACHABLE when no node answers)."""
    from concurrent.futures import ThreadPoolExecutor

    from cloudtrain.keys import ClusterKeys
    from cloudtrain.sshproxy import ssh_answers

    live = [r for r in rows if not env.provider_class(r.provider).powers_off]
    nodes = [n for r in live for n in r.nodes]
    if not nodes:
        return
    proxies = {r.name: ClusterKeys(env.pctx.cluster_dir(r.name) / "ssh").proxy for r in live}
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        found = list(pool.map(lambda n: "running" if ssh_answers(n, proxies[n.cluster],
                                                                 PROBE_TIMEOUT)
                              else "unreachable", nodes))
    for n, st in zip(nodes, found):
        n.status = st
    for r in live:
        down = [n for n in r.nodes if n.status != "running"]
        if down:
            r.status = "UNREACHABLE" if len(down) == len(r.nodes) else "DEGRADED"
            for n in down:
                env.ui.warn(f"'{r.name}' node {n.rank} ({n.user}@{n.host}:{n.port}) does not "
                            f"answer SSH within {PROBE_TIMEOUT:g} s")
