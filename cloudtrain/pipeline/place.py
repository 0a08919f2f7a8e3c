"""Place: where a launch's nodes go, decided once per launch, before anything is created.

The offers are ranked here, once: across the clouds installed with credentials when the
task leaves the choice open (the planner's pick, :mod:`cloudtrain.planner`), else over the
named cloud's own offers. Each ranked offer becomes a :class:`Target` through its cloud's
placement protocol (:class:`~cloudtrain.provider.contract.Places`: the regions the cloud's
options allow, what an offer means there, e.g. GCP's GPUs attached to N1 machines). The
plan carries the ranked targets; ``provision`` hops between them and hands each cloud the
targets that are its own on the request. Providers that place nothing (local, ssh, and
fakes without the protocol) get targets of the offers as they are, or none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cloudtrain.provider import fabric
from cloudtrain.catalog.model import Offer
from cloudtrain.context import Env
from cloudtrain.errors import UserError
from cloudtrain.provider.contract import ClusterRequest, Places, Plan, Provider, Target

if TYPE_CHECKING:
    from cloudtrain.ranking import RankedOffer
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


@dataclass(frozen=True)
class Pick:
    """The planner's pick for a task that leaves the choice open: the task with the first
    choice written in, the choices in rank order (plans with the planner's price), their
    targets (one per choice, empty when the cluster exists: its cloud places it), notes."""

    task: Task
    choices: tuple[Plan, ...]
    targets: tuple[Target, ...]
    notes: tuple[str, ...]


def pick_for(env: Env, task: Task, name: str, *, offers: list[Offer] | None = None
             ) -> Pick | None:
    """The planner's pick for cluster ``name`` (None when the task names its cloud and
    region, or asks for no GPU or instance type): the offers ranked once across the usable
    clouds. A cluster that exists keeps its provider, region and instance type."""
    from cloudtrain import planner

    if not planner.needs_pick(task):
        return None
    existing = env.state.get_cluster(name)
    if existing is not None:
        choice, notes = planner.kept(task, existing)
        return Pick(planner.resolved(task, choice), (choice,), (), tuple(notes))
    net = task.resources.network   # fast: only the types with a fabric (docs/network.md)
    ranked, notes = planner.pick_ranked(
        task, None if offers is None else fabric.fast_only(net, offers),
        load=lambda: fabric.fast_only(net, planner.catalog_offers(env.home)))
    choices = tuple(planner.choice_of(r, task) for r in ranked)
    providers = {p: env.provider(p) for p in dict.fromkeys(r.offer.provider for r in ranked)}
    targets = tuple(_target_of(providers[r.offer.provider], r) for r in ranked)
    return Pick(planner.resolved(task, choices[0]), choices, targets, tuple(notes))


def _target_of(provider: Provider, r: RankedOffer) -> Target:
    """A ranked offer as its cloud's target (as it is, for a provider without the
    placement protocol)."""
    o = r.offer
    if isinstance(provider, Places):
        return provider.target_of(o, r.per_node)
    return Target(o.provider, o.region, o.instance_type, r.per_node, tuple(o.zones))


def cloud_targets(places: Places, request: ClusterRequest) -> list[Target]:
    """The named cloud's targets for ``request``, in order: its offers ranked once, the best
    per region, in the regions its options allow (the task's own instance type in each of
    them even where the catalog has no price). Creates
    nothing and calls nothing (the catalog is local). [] when the task asks for no GPU or
    instance type (the cloud's check says so)."""
    from cloudtrain.ranking import rank

    res = request.resources
    if res.accelerators is None and not res.instance_type:
        return []
    region = places.region_of(request)
    wanted = places.wanted_regions(request, region)
    if res.network == "fast" and fabric.fabric_of(places.name, res.instance_type) is None \
            and res.instance_type:
        raise fabric.no_fabric(places.name, res.instance_type)
    offers = fabric.fast_only(res.network, places.offers())
    result = rank(res.model_copy(update={"provider": places.name, "zone": None,
                                         "region": region}),
                  request.num_nodes, offers, spot=res.use_spot,
                  max_hourly_cost=res.max_hourly_cost)
    best: dict[str, Target] = {}
    for r in result.ranked:
        if r.offer.region not in best and (not wanted or r.offer.region in wanted):
            best[r.offer.region] = places.target_of(r.offer, r.per_node)
    if wanted:
        out = [best[w] for w in wanted if w in best]
        if res.instance_type:   # types the catalog does not price still run
            out = [best.get(w) or places.unpriced_target(request, w) for w in wanted]
    else:
        out = list(best.values()) or places.unlisted_targets(request, region, offers)
    if not out:
        raise result.error() if not result.ranked else UserError(
            f"No offer for {result.want} in {', '.join(wanted)}.",
            places.regions_hint)
    return out


def placed(provider: Provider, request: ClusterRequest) -> ClusterRequest:
    """``request`` with the targets of ``provider`` (ranked once, :func:`cloud_targets`),
    for a cloud; as it is for a provider that places nothing."""
    if not isinstance(provider, Places):
        if request.resources.network == "fast":   # only the clouds set a fabric up
            raise UserError(f"resources.network: fast, but the {provider.name} provider sets no "
                            "fast network up: its nodes use the network the machines have. "
                            "Nothing was created.",
                            "Leave resources.network out (or write plain); the fast network is "
                            "for the aws, gcp and azure providers (docs/network.md).")
        return request
    return replace(request, targets=tuple(cloud_targets(provider, request)))
