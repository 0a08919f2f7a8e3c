"""``cloudtrain stop`` / ``start``: a cluster's nodes stopped (compute stops billing, each node
keeps its disk and files) and started again, where the provider can
(:class:`~cloudtrain.provider.contract.StopsNodes`).

Stopping closes the cluster's usage interval (the ledger counts no compute while it is
stopped) and records the cluster STOPPED. Starting is what ``up`` does with a stopped
cluster (pipeline/provision.py: ``create_nodes`` starts the stopped nodes, a new usage
interval opens at the price in force), from the cluster's own record rather than a task
file, and then the node guards are started again with the policy saved for the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloudtrain.errors import ClusterNotFound, CloudtrainError, UserError
from cloudtrain.provider.contract import StopsNodes

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.provider.contract import Provider
    from cloudtrain.schema import ClusterRow
    from cloudtrain.taskmodel import Task


@dataclass(frozen=True)
class Stopped:
    """What ``stop`` did: the cluster, whether it was stopped already, what still bills."""

    name: str
    already: bool
    still_bills: str


def stoppable(env: Env, name: str) -> tuple[ClusterRow, Provider]:
    """The cluster's record and its provider, which must be able to stop nodes (exit 2 if
    not, naming what to do instead)."""
    row = env.state.get_cluster(name)
    if row is None:
        raise ClusterNotFound(name, [c.name for c in env.state.list_clusters()])
    provider = env.provider(row.provider)
    if not isinstance(provider, StopsNodes):
        raise UserError(
            f"Provider '{row.provider}' cannot stop or start its nodes (cluster '{name}'): "
            "they are machines cloudtrain does not power.",
            f"Leave the cluster as it is, or tear it down: cloudtrain down {name}")
    return row, provider


def busy_job(env: Env, name: str) -> str | None:
    """The job that runs or waits on the cluster (words for the refusal), None when none.
    Nodes that cannot be asked are an error: stop --force goes ahead without asking."""
    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.pipeline import queue

    handle = get_handle(env, name)
    try:
        group = connect(env, handle, timeout=30)
    except CloudtrainError as exc:
        raise UserError(f"Could not ask the nodes of '{name}' whether a job runs ({exc.message})",
                        f"Check them with 'cloudtrain status {name} --refresh', or stop "
                        f"without asking: cloudtrain stop {name} --force") from None
    try:
        busy = queue.active(queue.records(handle, group))
    finally:
        group.close()
    if not busy:
        return None
    first = busy[0]
    more = f", {len(busy) - 1} more queued" if len(busy) > 1 else ""
    return f"job {first['id']} ({first.get('task')}) is {first.get('state')}{more}"


def stop(env: Env, name: str, *, force: bool) -> Stopped:
    """Stop the cluster's nodes (refused, exit 2, while a job runs or waits, unless
    ``force``); close its usage interval; record it STOPPED."""
    from cloudtrain.cluster import cluster_lock, node_rows
    from cloudtrain.pipeline.signals import Shielded

    row, provider = stoppable(env, name)
    assert isinstance(provider, StopsNodes)
    bills = provider.stopped_still_bills(name)
    if row.status == "STOPPED":
        return Stopped(name, True, bills)
    if not force:
        job = busy_job(env, name)
        if job is not None:
            raise UserError(f"Cluster '{name}' is busy: {job}. Stopping it would kill the job.",
                            f"Wait for it ('cloudtrain queue {name}'), cancel it ('cloudtrain "
                            f"cancel {name}'), or stop anyway: cloudtrain stop {name} --force")
    with cluster_lock(env, name), Shielded():
        env.ui.step(f"Stopping {row.num_nodes} node(s) of '{name}' on {row.provider}")
        provider.stop_nodes(name)
        env.state.close_usage(name, reason="stopped")
        env.state.replace_nodes(name, node_rows(name, provider.list_nodes(name)))
        env.state.set_cluster_status(name, "STOPPED")
    return Stopped(name, False, bills)


def task_of(row: ClusterRow) -> Task:
    """The task ``start`` provisions with: the cluster's recorded resources and node count
    (what ``up`` created it with), and nothing to run."""
    from cloudtrain.taskmodel import Task

    return Task.model_validate({"name": row.name, "num_nodes": row.num_nodes,
                                "resources": row.resources or {"provider": row.provider},
                                "run": "true"})


def start(env: Env, name: str) -> Handle | None:
    """Start a stopped cluster's nodes (as ``up`` would: same nodes, same disks), wait for
    SSH, and start the node guards again with the cluster's saved policy. None when every
    node ran already."""
    from cloudtrain.pipeline import guard as node_guard
    from cloudtrain.pipeline.provision import opened

    row, provider = stoppable(env, name)
    if row.status == "UP" and all(n.status == "running" for n in provider.list_nodes(name)):
        return None
    with opened(env, task_of(row), name) as (handle, group, _fresh):
        env.ui.ok(f"SSH up on {len(handle.nodes)} node(s)")
        node_guard.install(env, handle, group, None)
    return handle
