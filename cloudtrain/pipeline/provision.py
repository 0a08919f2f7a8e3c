"""Provision: make sure a cluster's nodes exist and run, adopting what exists (reconciled by
the cluster's tag), and record them; roll a cluster this call created back when a later
step fails. A new cluster whose provider was never reached (no SDK, no credentials, no
caller address: :func:`cloudtrain.errors.reached_nothing`) leaves nothing behind: no state
row, no folder, and no rollback to report.

Where to launch is the plan's (its ranked targets, :mod:`cloudtrain.pipeline.place`); this
step ranks nothing. When the planner picked the offer, a capacity or quota failure rolls
back and hops to the next target of the same ranked list (the plan's alternatives, across
providers); a named cloud is handed all of its targets and walks them itself."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

from cloudtrain import sshconfig
from cloudtrain.cluster import Handle, cluster_lock, connect, node_rows
from cloudtrain.context import Env
from cloudtrain.errors import CapacityError, ProviderError, QuotaError, UserError, reached_nothing
from cloudtrain.keys import (FIRST_CONTACT, PINNED_AT_CREATION, ensure_keys, is_pinned,
                             pin_host_keys, record_pinning)
from cloudtrain.pipeline.teardown import forget_files
from cloudtrain.pipeline.place import placed
from cloudtrain.pipeline.plan import check_mounts, cluster_request, plan, plan_on
from cloudtrain.pipeline.signals import Shielded
from cloudtrain.provider import registry
from cloudtrain.provider.contract import (Allocates, HasHostKeySource, HasMasterPort, Plan,
                                          Provider, ReportsAttempts)
from cloudtrain.remote import Group
from cloudtrain.schema import ClusterRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def provision(env: Env, task: Task, name: str, *, keep_on_failure: bool = False,
              planned: Plan | None = None) -> tuple[Handle, bool]:
    """Make sure the cluster's nodes exist and run; adopt what exists. Returns the handle and
    whether this call created the cluster (so a failure afterwards can roll it back).
    ``planned``: the result of :func:`plan` for this task, when the caller has it already
    (the provider's check and plan are then not asked again)."""
    from cloudtrain import planner

    if planner.needs_pick(task):  # the planner picks, and fails over down its ranked list
        return _provision_picked(env, task, name, keep_on_failure=keep_on_failure,
                                 planned=planned)
    return _provision(env, task, name, keep_on_failure=keep_on_failure, planned=planned)


def _provision(env: Env, task: Task, name: str, *, keep_on_failure: bool,
               planned: Plan | None) -> tuple[Handle, bool]:
    named = str(task.resources.provider)   # decided: named by the task or by the plan
    registry.require_sdk(named)   # before anything is written here
    existing = env.state.get_cluster(name)
    if existing is not None and existing.provider != task.resources.provider:
        raise UserError(
            f"Cluster '{name}' already exists on provider '{existing.provider}'; the task asks for "
            f"'{task.resources.provider}'.",
            f"Use another name (-c) or take it down first: cloudtrain down {name}")
    if existing is not None and existing.num_nodes != task.num_nodes:
        raise UserError(
            f"Cluster '{name}' has {existing.num_nodes} node(s); the task asks for {task.num_nodes}.",
            f"Use another name (-c) or take it down first: cloudtrain down {name}")
    provider = env.provider(named)
    check_mounts(task, provider)
    with _nothing_made_leaves_nothing(env, name, new=existing is None) as progress:
        return _make(env, task, name, provider, existing, progress,
                     keep_on_failure=keep_on_failure, planned=planned)


@dataclass
class Progress:
    """How far one ``up`` got: ``creating`` once it asks the provider to create anything."""

    creating: bool = False


@contextmanager
def _nothing_made_leaves_nothing(env: Env, name: str, *, new: bool) -> Iterator[Progress]:
    """An ``up`` of a new cluster that fails before it asked the provider to create anything,
    or whose provider was never reached, leaves the state as it found it: the row it wrote
    and the folder it made are removed, silently (there is nothing to roll back)."""
    made_dir = new and not env.pctx.cluster_dir(name).exists()
    progress = Progress()
    try:
        yield progress
    except BaseException as exc:
        if new and (not progress.creating or reached_nothing(exc)):
            env.state.delete_cluster(name)
            if made_dir:
                forget_files(env, name)
        raise


def _make(env: Env, task: Task, name: str, provider: Provider, existing: ClusterRow | None,
          progress: Progress, *, keep_on_failure: bool, planned: Plan | None
          ) -> tuple[Handle, bool]:
    keys = ensure_keys(env.pctx.cluster_dir(name), comment=f"cloudtrain-{name}",
                       proxy=task.resources.ssh_proxy)
    request = cluster_request(task, name, keys.public_key())
    if planned is None:
        provider.check(request)
        request = placed(provider, request)   # the cloud's targets, ranked once
    else:
        request = replace(request, targets=planned.targets)

    with cluster_lock(env, name):
        live = provider.list_nodes(name)
        fresh = existing is None and not live
        if (existing is not None and existing.status == "UP" and len(live) == task.num_nodes
                and all(n.status == "running" for n in live)
                and [n.instance_id for n in live] == [n.instance_id for n in existing.nodes]):
            return Handle(existing, provider, keys), False

        p = planned or provider.plan(request)
        row = ClusterRow(
            name=name, provider=provider.name, status="INIT", num_nodes=task.num_nodes,
            created_at=existing.created_at if existing else time.time(), updated_at=time.time(),
            region=p.region, zone=p.zone, instance_type=p.instance_type,
            accelerators=str(task.resources.accelerators) if task.resources.accelerators else None,
            use_spot=task.resources.use_spot, hourly_price=p.hourly_price_per_node,
            options=request.options.model_dump(mode="json") if request.options else {},
            resources=task.resources.model_dump(mode="json"),
        )
        progress.creating = True
        env.state.upsert_cluster(row)
        try:
            env.ui.step(f"Provisioning {task.num_nodes} node(s) on {provider.name} for '{name}'")
            net = provider.ensure_network(request)
            nodes = provider.create_nodes(request, net)
            if len(nodes) != task.num_nodes:
                raise ProviderError(f"the provider returned {len(nodes)} node(s) for "
                                    f"{task.num_nodes} requested.", "Run 'cloudtrain up' again.")
        except BaseException as exc:
            if fresh and not keep_on_failure and not reached_nothing(exc):
                roll_back(env, provider, name)
            raise
        old_ids = {n.rank: n.instance_id for n in (existing.nodes if existing else [])}
        for n in nodes:
            if n.host_keys:
                pin_host_keys(keys.known_hosts, n.host, n.port, n.host_keys)
        row.nodes = node_rows(name, nodes)
        env.state.replace_nodes(name, row.nodes)
        row.master_port = int(provider.master_port(name)) if isinstance(provider, HasMasterPort) \
            else 29500
        row.status = "UP"
        env.state.upsert_cluster(row)
        env.state.open_usage(row)
        stored = env.state.get_cluster(name)
        assert stored is not None
        # Nodes that are new (not the instance we knew) may have their host key learned.
        through = isinstance(provider, Allocates)   # a scheduler's nodes: no SSH, no host key
        learn = frozenset(n.rank for n in nodes if not through
                          and not n.host_keys and old_ids.get(n.rank) != n.instance_id
                          and not is_pinned(keys.known_hosts, n.host, n.port))
        source = provider.host_key_source if isinstance(provider, HasHostKeySource) \
            else PINNED_AT_CREATION
        record_pinning(keys, {n.rank: source for n in nodes if n.host_keys or through}
                       | {r: FIRST_CONTACT for r in learn})
        return Handle(stored, provider, keys, learn), fresh


def _provision_picked(env: Env, task: Task, name: str, *, keep_on_failure: bool,
                      planned: Plan | None) -> tuple[Handle, bool]:
    """Provision on the planner's pick; when that offer has no capacity or quota, roll back
    and hop to the next target of the same ranked list (planned once: nothing is ranked
    again)."""
    from cloudtrain import planner

    planned = planned or plan(env, task, name)
    choices = [planned, *planned.alternatives]
    for i, choice in enumerate(choices):
        resolved = planner.resolved(task, choice)
        # a pick hands one target per hop; a kept cluster its cloud's targets
        hop = planned.targets[i:i + 1] if planned.alternatives else planned.targets
        p = replace(choice if i == 0 else planner.fill(plan_on(env, resolved, name, hop),
                                                       choice, [], []), targets=hop)
        try:
            return _provision(env, resolved, name, keep_on_failure=keep_on_failure, planned=p)
        except (CapacityError, QuotaError) as exc:
            if keep_on_failure or i + 1 == len(choices) or env.state.get_cluster(name) is not None:
                raise
            nxt = choices[i + 1]
            env.ui.warn(f"{choice.provider} {choice.instance_type} in {choice.region}: "
                        f"{exc.message} Failing over to {nxt.provider} {nxt.instance_type} in "
                        f"{nxt.region}.")
    raise AssertionError("unreachable")


def roll_back(env: Env, provider: Provider, name: str) -> None:
    """Remove what was created for a cluster this command created, when a later step failed
    or was interrupted. No signal cuts it off half-way (the cluster would be left billing)."""
    with Shielded():
        env.ui.warn(f"Rolling back: removing what was created for '{name}'.")
        try:
            provider.terminate(name)
            env.state.close_usage(name)
            env.state.delete_cluster(name)
            forget_files(env, name)
        except Exception as exc:  # noqa: BLE001 - report, keep the original error
            env.ui.error(f"Rollback of '{name}' failed: {exc}. Run 'cloudtrain down {name}'.")


@contextmanager
def opened(env: Env, task: Task, name: str, *, keep_on_failure: bool = False,
           planned: Plan | None = None) -> Iterator[tuple[Handle, Group, bool]]:
    """Provision and connect to every node; yields (handle, connections, created by this
    call). A cluster this call created is rolled back when it cannot be reached."""
    handle, fresh = provision(env, task, name, keep_on_failure=keep_on_failure, planned=planned)
    try:
        with env.ui.status("Waiting for SSH on every node"):
            group = connect(env, handle)
        sshconfig.refresh(env.home, handle, env.ui.warn)   # ssh NAME: its address, key, host key
    except BaseException:
        if fresh and not keep_on_failure:
            roll_back(env, handle.provider, name)
        raise
    try:
        yield handle, group, fresh
    finally:
        group.close()


def attempts(env: Env, name: str, planned: Plan) -> list[dict[str, Any]]:
    """Every placement attempt the providers involved remember for ``name``, in order, each
    with its provider (providers without ``attempts`` contribute nothing)."""
    names = [planned.provider] + [a.provider for a in planned.alternatives]
    out: list[dict[str, Any]] = []
    for p in dict.fromkeys(n for n in names if n):
        provider = env.provider(p)
        if isinstance(provider, ReportsAttempts):
            out += [{"provider": p, **a} for a in provider.attempts(name)]
    return out
