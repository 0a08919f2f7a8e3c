"""The planner: which offer ``up`` takes for a task, and the failover order after it.

The ranking itself (which catalog offers can run a task, cheapest first, and why the others
can't) is ``ranking`` (its names are imported from there). This module adds what ``up``
needs when a task names no provider (or a cloud but no region): the clouds that are
installed and have credentials (``availability``), the pick among them (``choose``,
``pick_for_up``), the task with the choice written in (``resolved``) and the provider's plan
filled from it (``fill``). ``cloudtrain cost`` and ``pipeline.plan.plan`` are its two users.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from cloudtrain.catalog.model import Offer
from cloudtrain.errors import UserError
from cloudtrain.memfit import MemoryEstimate
from cloudtrain.ranking import (ANY_GPU, CLOUDS, FREE, PlanResult, RankedOffer,
                                rank_task)

if TYPE_CHECKING:
    from cloudtrain.provider.contract import Plan
    from cloudtrain.taskmodel import Resources, Task
    from cloudtrain.schema import ClusterRow

__all__ = ["availability", "catalog_offers", "choice_of", "choose", "fill", "kept",
           "needs_pick", "pick_for_up", "pick_ranked", "resolved"]


# --------------------------------------------------------------------------------------------
# Choosing a provider for up / launch


def needs_pick(task: Task) -> bool:
    """Whether ``up`` asks the planner: the task wants GPUs (or an instance type) and names
    no provider, or names a cloud but no region."""
    r = task.resources
    if r.accelerators is None and not r.instance_type:
        return False
    return r.provider is None or (r.provider in CLOUDS and r.region is None)


def availability(candidates: Iterable[str] = CLOUDS) -> dict[str, str | None]:
    """For each cloud: None when ``up`` can use it (installed, with its SDK, and credentials
    present), else why not. Reads the registry and credential files; imports no SDK."""
    from cloudtrain import credentials
    from cloudtrain.provider import registry

    installed = set(registry.names())
    out: dict[str, str | None] = {}
    for p in sorted(set(candidates)):
        if p not in installed or registry.sdk_missing(p) is not None:
            out[p] = f"not installed (pip install 'cloudtrain[{p}]')"
        elif not credentials.present(p):
            out[p] = "no credentials found"
        else:
            out[p] = None
    return out


def _no_provider_error(resources: Resources, avail: Mapping[str, str | None]) -> UserError:
    from cloudtrain import credentials

    what = (f"resources.accelerators {resources.accelerators}" if resources.accelerators
            else f"resources.instance_type {resources.instance_type}")
    missing = sorted(p for p, why in avail.items() if why and why.startswith("not installed"))
    nocreds = sorted(p for p, why in avail.items() if why == "no credentials found")
    parts = []
    if missing:
        parts.append(f"not installed: {', '.join(missing)}")
    if nocreds:
        parts.append(f"installed without credentials: {', '.join(nocreds)}")
    hint = []
    if nocreds:
        hint.append(f"Configure {nocreds[0]}: {credentials.how_to(nocreds[0])}.")
    if missing:
        hint.append(f"{'Or install' if hint else 'Install'} a cloud, e.g. pip install "
                    f"'cloudtrain[{missing[0]}]', and configure its credentials.")
    hint.append("Or name one in resources.provider.")
    return UserError(
        f"The task names no provider and asks for {what}, so up picks the cheapest cloud, but "
        f"no cloud is usable ({'; '.join(parts)}).", " ".join(hint))


def choose(task: Task, offers: Iterable[Offer], *, fit: MemoryEstimate | None = None,
           avail: Mapping[str, str | None] | None = None) -> PlanResult:
    """The ranked offers ``up`` may take for a task that names no provider: among clouds that
    are installed and have credentials. Raises UserError when none is usable or nothing fits."""
    offers = list(offers)
    if avail is None:
        avail = availability(set(CLOUDS) | {o.provider for o in offers})
    usable = [p for p, why in avail.items() if why is None]
    if not usable:
        raise _no_provider_error(task.resources, avail)
    result = rank_task(task, offers, fit=fit, providers=usable,
                       unavailable={p: why for p, why in avail.items() if why})
    result.providers = dict(avail)
    result.require()
    return result


def resolved(task: Task, choice: Plan) -> Task:
    """The task with the planner's choice written in (provider, region, instance type, and
    the GPU model for ``any:N``): what ``provision`` asks the provider for."""
    from cloudtrain.taskmodel import Accelerators

    res = task.resources
    update: dict[str, Any] = {"provider": choice.provider, "region": choice.region,
                              "instance_type": choice.instance_type}
    if choice.zone:
        update["zone"] = choice.zone
    if res.accelerators is not None and res.accelerators.name.lower() in ANY_GPU \
            and choice.accelerators:
        name, _, _ = choice.accelerators.partition(":")
        update["accelerators"] = Accelerators(name=name, count=res.accelerators.count)
    return task.model_copy(update={"resources": res.model_copy(update=update)})


def choice_of(r: RankedOffer, task: Task) -> Plan:
    """A ranked offer as the plan of ``up`` on it (provider, region, type, GPUs, price)."""
    from cloudtrain.provider.contract import Plan

    o = r.offer
    zone = task.resources.zone
    acc = f"{o.accelerator}:{o.accelerator_count:g}" if o.accelerator else None
    return Plan(provider=o.provider, num_nodes=r.num_nodes, region=o.region, zone=zone,
                instance_type=o.instance_type, accelerators=acc, use_spot=r.spot,
                hourly_price_per_node=r.per_node)


def kept(task: Task, existing: ClusterRow) -> tuple[Plan, list[str]]:
    """The choice for a cluster that exists: its provider, region and instance type, and
    the note that says so."""
    from cloudtrain.provider.contract import Plan

    acc = str(task.resources.accelerators) if task.resources.accelerators else None
    return (Plan(provider=existing.provider, num_nodes=task.num_nodes, region=existing.region,
                 zone=existing.zone, instance_type=existing.instance_type,
                 accelerators=existing.accelerators or acc, use_spot=existing.use_spot,
                 hourly_price_per_node=existing.hourly_price),
            [f"cluster '{existing.name}' exists on {existing.provider}; up keeps it there"])


def pick_ranked(task: Task, offers: Iterable[Offer] | None, *,
                load: Callable[[], Iterable[Offer]] | None = None
                ) -> tuple[list[RankedOffer], list[str]]:
    """For a task without a provider (or a cloud without a region): the feasible offers in
    rank order (the first is the pick, the others the failover order) and the notes that
    say so. Without a provider the pick is among the clouds installed with credentials; a
    named cloud is taken as is (its own check speaks for its credentials)."""
    named = task.resources.provider
    avail = {named: None} if named else availability(CLOUDS)
    if not any(why is None for why in avail.values()):
        raise _no_provider_error(task.resources, avail)   # before reading any catalog
    if offers is None:
        assert load is not None, "give the offers or a way to load them"
        offers = load()
    offers = list(offers)
    extra = {o.provider for o in offers} - set(CLOUDS) - set(FREE)
    if extra and not named:
        avail = {**avail, **availability(extra)}
    result = choose(task, offers, avail=avail)
    usable = sorted(p for p, why in result.providers.items() if why is None)
    notes = [f"picked by the planner: the cheapest of {len(result.ranked)} feasible offer(s) on "
             + (f"{named} (no region in the task)" if named else
                f"{', '.join(usable)} (clouds installed with credentials)")]
    if len(result.ranked) > 1:
        nxt = ", ".join(f"{r.offer.provider} {r.offer.instance_type} {r.offer.region} "
                        f"${r.cluster:.2f}/h" for r in result.ranked[1:4])
        notes.append(f"failover order if it has no capacity: {nxt}"
                     + (", ..." if len(result.ranked) > 4 else ""))
    return list(result.ranked), notes


def pick_for_up(task: Task, offers: Iterable[Offer] | None, existing: ClusterRow | None = None,
                *, load: Callable[[], Iterable[Offer]] | None = None
                ) -> tuple[Plan, list[Plan], list[str]]:
    """For a task without a provider (or a cloud without a region): (the choice, the failover
    order after it, notes), from :func:`pick_ranked`. A cluster that exists already keeps
    its provider, region and instance type (:func:`kept`)."""
    if existing is not None:
        choice, notes = kept(task, existing)
        return choice, [], notes
    ranked, notes = pick_ranked(task, offers, load=load)
    choices = [choice_of(r, task) for r in ranked]
    return choices[0], choices[1:], notes


def fill(p: Plan, choice: Plan, alternatives: list[Plan], notes: list[str]) -> Plan:
    """The provider's plan with the planner's choice written in where the provider left a
    blank (price, region, instance type, GPUs), the failover order and the planner's notes
    first (a new plan; ``p`` is left as it is)."""
    return replace(p, hourly_price_per_node=(choice.hourly_price_per_node
                                             if p.hourly_price_per_node is None
                                             else p.hourly_price_per_node),
                   region=p.region or choice.region, zone=p.zone or choice.zone,
                   instance_type=p.instance_type or choice.instance_type,
                   accelerators=p.accelerators or choice.accelerators,
                   use_spot=p.use_spot or choice.use_spot, alternatives=list(alternatives),
                   notes=[*notes, *p.notes])


def catalog_offers(home: Path | None) -> list[Offer]:
    """The offers of the catalog in use (the user's refreshed one, else the snapshot)."""
    from cloudtrain.catalog.load import load_catalog

    return list(load_catalog(home).offers)
