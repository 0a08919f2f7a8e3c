"""Plan: what ``up`` would do for a task, creating nothing anywhere: the provider, region,
instance and price (the planner's pick when the task leaves them open), the ranked targets
(decided once, by :mod:`cloudtrain.pipeline.place`), the request the provider is handed,
and the checks a task must pass before anything is provisioned."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cloudtrain.catalog.model import Offer
from cloudtrain.context import Env
from cloudtrain.errors import UserError
from cloudtrain.pipeline import place
from cloudtrain.provider.contract import ClusterRequest, Plan, Provider, Target
from cloudtrain.provider.options import provider_options

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def cluster_request(task: Task, name: str, public_key: str,
                    targets: tuple[Target, ...] = ()) -> ClusterRequest:
    return ClusterRequest(name=name, num_nodes=task.num_nodes, resources=task.resources,
                          options=provider_options(task), public_key=public_key,
                          max_hours=task.max_hours, buckets=tuple(task.bucket_urls()),
                          targets=targets)


def plan(env: Env, task: Task, name: str, *, offers: list[Offer] | None = None) -> Plan:
    """What ``up`` would do. Creates nothing, anywhere. A task with GPUs (or an instance type)
    that names no provider, or a cloud but no region, gets the planner's cheapest feasible
    offer (from ``offers``, or the catalog when None). The offers are ranked once
    (:mod:`cloudtrain.pipeline.place`); the plan carries the ranked targets."""
    from cloudtrain import planner

    existing = env.state.get_cluster(name)
    picked = place.pick_for(env, task, name, offers=offers)
    if picked is None:
        p = plan_on(env, task, name, None)
    else:
        p = plan_on(env, picked.task, name, picked.targets[:1] or None)
        p = planner.fill(p, picked.choices[0], list(picked.choices[1:]), list(picked.notes))
        p = replace(p, targets=picked.targets or p.targets)
    cap = task.resources.max_hourly_cost
    if cap is not None and existing is None and p.hourly_price_per_node is not None \
            and p.hourly_price_per_node * p.num_nodes > cap:
        raise UserError(
            f"{p.provider} {p.instance_type or ''} in {p.region or '-'} costs "
            f"${p.hourly_price_per_node * p.num_nodes:.2f}/h for {p.num_nodes} node(s), over "
            f"resources.max_hourly_cost ${cap:.2f}/h. Nothing was created.",
            "Raise max_hourly_cost, use fewer or smaller nodes, or leave out the provider/region "
            "so the planner can look for a cheaper offer ('cloudtrain cost TASK' lists them).")
    if existing is not None:
        p = replace(p, notes=[f"cluster '{name}' exists ({existing.status}); up adopts its "
                              "nodes", *p.notes])
    return p


def plan_on(env: Env, task: Task, name: str, targets: tuple[Target, ...] | None) -> Plan:
    """The provider's plan for ``task`` (its provider and region decided): its check, then
    ``targets`` (None: the cloud's own, ranked once by :func:`place.placed`), then its plan,
    which carries the targets."""
    provider = env.provider(str(task.resources.provider))
    request = cluster_request(task, name, public_key="")
    provider.check(request)
    request = place.placed(provider, request) if targets is None else replace(
        request, targets=targets)
    return replace(provider.plan(request), targets=request.targets)


def check_mounts(task: Task, provider: Provider) -> None:
    if provider.allows_absolute_mounts:
        return
    for remote in task.file_mounts:
        if remote.startswith("/") or remote.startswith("~"):
            raise UserError(
                f"file_mounts target '{remote}' is an absolute path, and provider "
                f"'{provider.name}' nodes share this machine's file system.",
                "Use a path relative to the workdir on the node (e.g. 'data: ./data'), which works "
                "on every provider.")
