"""The ranking: which catalog offers can run a task, cheapest first, and why the others can't.

``rank`` is pure: it takes the task's resources and a list of offers (injected, never loaded
here) and returns a :class:`PlanResult` (the feasible offers as :class:`RankedOffer`, the
others grouped as :class:`Rejection`, and the nearest relaxations when nothing fits). The
ranking rules are in docs/cost.md; ``planner`` builds the choice for ``up`` on top of it.
"""

from __future__ import annotations

import re

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from cloudtrain.catalog.gpus import canonical_gpu, suggest_gpu
from cloudtrain.catalog.model import Offer
from cloudtrain.errors import UserError
from cloudtrain.memfit import USABLE_FRACTION, Breakdown, MemoryEstimate

if TYPE_CHECKING:
    from cloudtrain.sizes import SizeAsk
    from cloudtrain.taskmodel import Resources, Task

CLOUDS = ("aws", "gcp", "azure")
"""Providers the catalog prices; the planner picks among them when a task names none."""
FREE = ("local", "ssh")
"""Providers that run on machines the user already has: no catalog, no price."""
ANY_GPU = ("any", "*")
"""``accelerators: any:8``: any GPU model, 8 per node (memory fit and price choose)."""

_SELECTORS = ("gpu", "instance_type")
"""Constraints that pick the offers the others then judge: what they remove is the rest of
the catalog, not worth a line in an error unless nothing else is left."""

# The order constraints are checked in; an offer is rejected by the first it fails.
CONSTRAINTS = ("gpu", "instance_type", "count", "provider", "region", "zone", "cpus", "ram",
               "market", "memory", "max_hourly_cost")


@dataclass(frozen=True)
class RankedOffer:
    """A feasible offer and what it costs for this task."""

    offer: Offer
    num_nodes: int
    spot: bool
    per_node: float
    """$/h for one node in the chosen market (spot or on-demand)."""
    why: str
    """Why it is feasible, one line."""
    fit: Breakdown | None = None

    @property
    def cluster(self) -> float:
        """$/h for the whole cluster."""
        return self.per_node * self.num_nodes

    def total(self, hours: float) -> float:
        return self.cluster * hours

    @property
    def alternative_per_node(self) -> float | None:
        """$/h per node in the other market (spot when this is on-demand, and back)."""
        return self.offer.hourly(not self.spot)

    @property
    def spot_saving(self) -> float | None:
        """Fraction of the on-demand price that spot saves (0.7 = 70 %), where both exist."""
        od, sp = self.offer.price, self.offer.spot_price
        if od is None or sp is None or od <= 0:
            return None
        return 1.0 - sp / od

    def key(self) -> tuple[Any, ...]:
        o = self.offer
        return (round(self.cluster, 4), o.provider, o.region, o.instance_type,
                o.accelerator or "", o.accelerator_count)

    def gpus(self) -> str:
        o = self.offer
        if not o.accelerator:
            return "-"
        return f"{o.accelerator_count:g}x{o.accelerator}"

    def to_dict(self, hours: float) -> dict[str, Any]:
        """The offer as ``cost --json`` lists it (see :func:`priced_json`), and why it is
        feasible."""
        return {**priced_json(self.offer, self.num_nodes, self.spot, hours), "why": self.why}


def priced_json(o: Offer, num_nodes: int, spot: bool, hours: float) -> dict[str, Any]:
    """An offer priced for ``num_nodes`` nodes in one market over ``hours``: the catalog
    fields of the JSON contract (``offer_json``) plus ``nodes``, ``cluster_hourly_usd``
    (node price in the market priced x nodes) and ``total_usd`` (that x hours), and extras:
    ``market``, ``node_hourly_usd`` (the price per node in that market), the spot cluster
    price and the spot saving. Also for offers that are not feasible (their price, where
    the market has one)."""
    from cloudtrain.catalog.model import offer_json

    per = o.hourly(spot)
    cluster = None if per is None else per * num_nodes
    od, sp = o.price, o.spot_price
    saving = None if od is None or sp is None or od <= 0 else 1.0 - sp / od
    return {
        **offer_json(o), "nodes": num_nodes, "market": "spot" if spot else "on-demand",
        "node_hourly_usd": None if per is None else round(per, 4),
        "cluster_hourly_usd": None if cluster is None else round(cluster, 4),
        "total_usd": None if cluster is None else round(cluster * hours, 2),
        "spot_cluster_hourly_usd": None if sp is None else round(sp * num_nodes, 4),
        "spot_saving_pct": None if saving is None else round(100 * saving, 1),
    }


@dataclass(frozen=True)
class Rejection:
    """Offers removed by one constraint, for one reason."""

    constraint: str
    reason: str
    offers: tuple[Offer, ...]

    @property
    def count(self) -> int:
        return len(self.offers)

    def __str__(self) -> str:
        return f"{self.count} offer{'s' if self.count != 1 else ''}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"constraint": self.constraint, "reason": self.reason, "count": self.count}


@dataclass
class PlanResult:
    want: str
    """What was asked, in words: "A100:8 x 2 nodes, on-demand"."""
    ranked: list[RankedOffer]
    rejected: list[Rejection]
    suggestions: list[str] = field(default_factory=list)
    """The nearest relaxations, when nothing is feasible."""
    memory: MemoryEstimate | None = None
    providers: dict[str, str | None] = field(default_factory=dict)
    """When the planner chose for ``up``: every cloud and why ``up`` can't use it (None: it can)."""

    @property
    def pick(self) -> RankedOffer | None:
        return self.ranked[0] if self.ranked else None

    def summary(self, limit: int = 5) -> str:
        """Which constraints removed what; "another GPU model" and "another instance type"
        (most of any catalog) only when nothing else explains it."""
        groups = sorted(self.rejected, key=lambda r: (CONSTRAINTS.index(r.constraint), -r.count,
                                                      r.reason))
        groups = [g for g in groups if g.constraint not in _SELECTORS] or groups
        text = "; ".join(str(g) for g in groups[:limit])
        if len(groups) > limit:
            text += f"; and {len(groups) - limit} more reason(s)"
        return text or "the catalog has no offers"

    def error(self) -> UserError:
        hint = ("Nearest: " + "; ".join(self.suggestions) + ".") if self.suggestions else \
            "Relax a constraint (GPU model or count, region, spot, max_hourly_cost)."
        return UserError(f"No offer fits {self.want}: {self.summary()}.", hint)

    def require(self) -> RankedOffer:
        if not self.ranked:
            raise self.error()
        return self.ranked[0]


# --------------------------------------------------------------------------------------------
# Ranking


@dataclass(frozen=True)
class _Ask:
    """The constraints, resolved."""

    num_nodes: int
    gpu: str | None          # canonical name; None: any model (or no GPU constraint)
    count: float | None
    any_gpu: bool
    instance_type: str | None
    region: str | None
    zone: str | None
    provider: str | None
    providers: frozenset[str] | None
    unavailable: Mapping[str, str]
    spot: bool
    max_hourly_cost: float | None
    fit: MemoryEstimate | None
    cpus: SizeAsk | None = None      # resources.cpus: vCPUs per node (sizes)
    ram: SizeAsk | None = None       # resources.memory: GB per node


def _want(ask: _Ask, resources: Resources) -> str:
    if resources.accelerators is not None:
        what = f"{'any GPU' if ask.any_gpu else ask.gpu}:{resources.accelerators.count}"
        if ask.instance_type:
            what += f" on {ask.instance_type}"
    else:
        what = str(ask.instance_type)
    sizes = [f"{size} {unit}" for size, unit in ((ask.cpus, "vCPUs"), (ask.ram, "GB memory"))
             if size]
    what += f" with {' and '.join(sizes)}" if sizes else ""
    where = [w for w in (ask.provider, ask.region, ask.zone) if w]
    text = f"{what} x {ask.num_nodes} node{'s' if ask.num_nodes != 1 else ''}"
    text += f", {'spot' if ask.spot else 'on-demand'}"
    if where:
        text += f" in {'/'.join(where)}"
    return text


def _resolve(resources: Resources, num_nodes: int, offers: list[Offer], *,
             providers: Iterable[str] | None, unavailable: Mapping[str, str] | None, spot: bool,
             max_hourly_cost: float | None, fit: MemoryEstimate | None) -> _Ask:
    acc = resources.accelerators
    if acc is None and not resources.instance_type:
        raise UserError(
            "The planner needs resources.accelerators (e.g. A100:8) or resources.instance_type "
            "to choose an offer.", "Add one of them to the task's resources.")
    gpu, any_gpu = None, False
    if acc is not None:
        if acc.name.strip().lower() in ANY_GPU:
            any_gpu = True
        else:
            gpu = canonical_gpu(acc.name)
            if gpu is None:
                known = sorted({o.accelerator for o in offers if o.accelerator})
                spelled = count_spelling(acc.name)
                close = suggest_gpu(acc.name, known)
                hint = (f"Did you mean '{spelled}' (NAME:COUNT)? " if spelled else
                        f"Did you mean '{close}'? " if close else "")
                raise UserError(
                    f"resources.accelerators: unknown GPU '{acc.name}'.",
                    hint + "Known here: " + (", ".join(known[:30]) or "none")
                    + ("" if len(known) <= 30 else ", ...") + "; or any:N for any model.")
    provider = resources.provider if resources.provider not in (None, *FREE) else None
    return _Ask(num_nodes=num_nodes, gpu=gpu, count=float(acc.count) if acc else None,
                any_gpu=any_gpu, instance_type=resources.instance_type, region=resources.region,
                zone=resources.zone, provider=provider,
                providers=frozenset(providers) if providers is not None else None,
                unavailable=dict(unavailable or {}), spot=spot,
                max_hourly_cost=max_hourly_cost, fit=fit, cpus=resources.cpus,
                ram=resources.memory)


def _gib(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _checks(ask: _Ask) -> list[tuple[str, Callable[[Offer], str | None]]]:
    """(constraint, test) in CONSTRAINTS order; a test returns why an offer fails, or None."""
    out: list[tuple[str, Callable[[Offer], str | None]]] = []

    def gpu(o: Offer) -> str | None:
        if ask.any_gpu:
            return None if o.accelerator else "no GPU"
        if ask.gpu is not None and (o.accelerator is None or canonical_gpu(o.accelerator) != ask.gpu):
            return f"another GPU model (not {ask.gpu})"
        return None
    out.append(("gpu", gpu))

    def itype(o: Offer) -> str | None:
        if ask.instance_type and o.instance_type.lower() != ask.instance_type.lower():
            return f"not instance type {ask.instance_type}"
        return None
    out.append(("instance_type", itype))

    def count(o: Offer) -> str | None:
        if ask.count is not None and o.accelerator_count != ask.count:
            return f"not {ask.count:g} GPUs per node"
        return None
    out.append(("count", count))

    def provider(o: Offer) -> str | None:
        if ask.provider is not None and o.provider != ask.provider:
            return f"on {o.provider}, the task asks for {ask.provider}"
        if ask.providers is not None and o.provider not in ask.providers:
            why = ask.unavailable.get(o.provider) or "not among the providers to choose from"
            return f"on {o.provider}: {why}"
        return None
    out.append(("provider", provider))

    def region(o: Offer) -> str | None:
        if ask.region and o.region != ask.region:
            return f"not in region {ask.region}"
        return None
    out.append(("region", region))

    def zone(o: Offer) -> str | None:
        if not ask.zone:
            return None
        if ask.zone in o.zones:
            return None
        # Zone names the catalog can't confirm (none listed, or AWS zone IDs like use1-az4,
        # which map to names per account) pass when they belong to the offer's region.
        named = any(z.startswith(o.region) for z in o.zones)
        return None if ask.zone.startswith(o.region) and not named else f"not in zone {ask.zone}"
    out.append(("zone", zone))
    out.append(("cpus", lambda o: ask.cpus.reject(o.vcpus, "vCPUs", "cpus") if ask.cpus else None))
    out.append(("ram", lambda o: ask.ram.reject(o.memory_gib, "GB memory", "memory")
                if ask.ram else None))

    def market(o: Offer) -> str | None:
        if o.hourly(ask.spot) is None:
            return "no spot price" if ask.spot else "not sold on demand"
        return None
    out.append(("market", market))

    def memory(o: Offer) -> str | None:
        if ask.fit is None:
            return None
        if not o.gpu_memory_gib:
            return "GPU memory unknown"
        b = ask.fit.breakdown(o.accelerator_count * ask.num_nodes)
        if b.fits(o.gpu_memory_gib):
            return None
        return (f"{_gib(o.gpu_memory_gib)} GiB per GPU: {_gib(o.gpu_memory_gib * USABLE_FRACTION)} "
                f"GiB usable < {_gib(b.needed_gib)} GiB needed")
    out.append(("memory", memory))

    def budget(o: Offer) -> str | None:
        per = o.hourly(ask.spot)
        if ask.max_hourly_cost is not None and per is not None \
                and per * ask.num_nodes > ask.max_hourly_cost + 1e-9:
            return f"over max_hourly_cost ${ask.max_hourly_cost:g}/h for the cluster"
        return None
    out.append(("max_hourly_cost", budget))
    return out


def _why(o: Offer, ask: _Ask, b: Breakdown | None) -> str:
    parts = [f"{o.accelerator_count:g} x {o.accelerator}" if o.accelerator else o.instance_type]
    per = o.hourly(ask.spot) or 0.0
    parts.append(f"{'spot' if ask.spot else 'on-demand'} ${per:.2f}/h per node")
    if b is not None and o.gpu_memory_gib:
        parts.append(f"{_gib(b.needed_gib)} GiB needed fits {_gib(o.gpu_memory_gib)} GiB")
    if ask.max_hourly_cost is not None:
        parts.append(f"${per * ask.num_nodes:.2f}/h <= max_hourly_cost ${ask.max_hourly_cost:g}/h")
    return ", ".join(parts)


def _evaluate(offers: list[Offer], ask: _Ask, skip: frozenset[str] = frozenset()
              ) -> tuple[list[RankedOffer], dict[tuple[str, str], list[Offer]]]:
    checks = [(k, t) for k, t in _checks(ask) if k not in skip]
    ranked: list[RankedOffer] = []
    groups: dict[tuple[str, str], list[Offer]] = defaultdict(list)
    for o in offers:
        for key, test in checks:
            reason = test(o)
            if reason is not None:
                groups[(key, reason)].append(o)
                break
        else:
            b = ask.fit.breakdown(o.accelerator_count * ask.num_nodes) if ask.fit else None
            ranked.append(RankedOffer(offer=o, num_nodes=ask.num_nodes, spot=ask.spot,
                                      per_node=float(o.hourly(ask.spot) or 0.0),
                                      why=_why(o, ask, b), fit=b))
    ranked.sort(key=RankedOffer.key)
    return ranked, groups


def _where(r: RankedOffer) -> str:
    o = r.offer
    return f"${r.cluster:.2f}/h on {o.provider} ({o.instance_type}, {o.region})"


def _suggest(offers: list[Offer], ask: _Ask, rejected: set[str]) -> list[str]:
    """Relax one constraint at a time; say what the cheapest result would be."""
    found: list[tuple[float, str]] = []

    def cheapest(a: _Ask, skip: Iterable[str] = ()) -> RankedOffer | None:
        ranked, _ = _evaluate(offers, a, frozenset(skip))
        return ranked[0] if ranked else None

    if "max_hourly_cost" in rejected and (r := cheapest(ask, ["max_hourly_cost"])):
        found.append((r.cluster, f"cheapest without max_hourly_cost: {_where(r)}"))
    if "memory" in rejected and ask.fit is not None:
        if ask.fit.strategy == "ddp" and (r := cheapest(replace(ask, fit=replace(ask.fit, strategy="fsdp")))):
            found.append((r.cluster, f"with --strategy fsdp it fits: {_where(r)}"))
        if not ask.any_gpu and ask.gpu is not None and (r := cheapest(ask, ["gpu"])):
            found.append((r.cluster, f"{r.offer.accelerator}:{r.offer.accelerator_count:g} fits: "
                                     f"{_where(r)}"))
    if "market" in rejected and (r := cheapest(replace(ask, spot=not ask.spot))):
        found.append((r.cluster, f"{'on-demand' if ask.spot else 'spot'} instead: {_where(r)}"))
    for key, label in (("region", "another region"), ("zone", "another zone")):
        if key in rejected and (r := cheapest(ask, [key])):
            found.append((r.cluster, f"in {label}: {_where(r)}"))
    for key, field_name in (("cpus", "cpus"), ("ram", "memory")):
        if key in rejected and (r := cheapest(ask, [key])):
            found.append((r.cluster, f"without resources.{field_name}: {_where(r)}"))
    if "provider" in rejected and (r := cheapest(ask, ["provider"])):
        why = ask.unavailable.get(r.offer.provider)
        found.append((r.cluster, f"on {r.offer.provider}{f' ({why})' if why else ''}: {_where(r)}"))
    found.sort()
    out = [text for _, text in found[:3]]
    if "count" in rejected and ask.gpu is not None:
        counts = sorted({o.accelerator_count for o in offers
                         if o.accelerator and canonical_gpu(o.accelerator) == ask.gpu
                         and (not ask.instance_type
                              or o.instance_type.lower() == ask.instance_type.lower())})
        if counts and ask.count not in counts:
            on = f" on {ask.instance_type}" if ask.instance_type else ""
            text = f"{ask.gpu} comes with {', '.join(f'{c:g}' for c in counts)} per node{on}"
            if (r := cheapest(ask, ["count"])):
                text += f" ({r.offer.accelerator_count:g} per node: {_where(r)})"
            out.append(text)
    if ask.instance_type and not any(o.instance_type.lower() == ask.instance_type.lower()
                                     for o in offers):
        from difflib import get_close_matches

        close = get_close_matches(ask.instance_type, sorted({o.instance_type for o in offers}), n=1)
        out.insert(0, f"the catalog has no instance type {ask.instance_type}"
                      + (f"; did you mean {close[0]}?" if close else ""))
    return out


_COUNT_FIRST = re.compile(r"^\s*(\d+)\s*[x*]\s*(\S.*?)\s*$", re.IGNORECASE)
_COUNT_LAST = re.compile(r"^\s*(\S.*?)\s*[x*]\s*(\d+)\s*$", re.IGNORECASE)


def count_spelling(text: str) -> str | None:
    """'H100:8' for a count written another way ('H100x8', '8xH100', '8 x h100', 'A100*4'),
    when the name part is a known GPU; else None."""
    for pattern, name_at, count_at in ((_COUNT_LAST, 1, 2), (_COUNT_FIRST, 2, 1)):
        m = pattern.match(text)
        if m and int(m.group(count_at)) > 0:
            canon = canonical_gpu(m.group(name_at))
            if canon is not None:
                return f"{canon}:{int(m.group(count_at))}"
    return None


def rank(resources: Resources, num_nodes: int, offers: Iterable[Offer], *,
         providers: Iterable[str] | None = None, spot: bool = False,
         max_hourly_cost: float | None = None, fit: MemoryEstimate | None = None,
         unavailable: Mapping[str, str] | None = None) -> PlanResult:
    """Feasible offers for ``num_nodes`` nodes of ``resources``, cheapest cluster first (ties:
    provider, region, instance type), and the rejected ones grouped by reason.

    ``providers``: only these may be picked (None: any); ``unavailable`` says why the others
    can't (shown in rejections). ``resources.provider`` (a cloud), ``region``, ``zone``,
    ``accelerators`` (``any:N`` for any model) and ``instance_type`` constrain too; ``spot``
    picks the market; ``max_hourly_cost`` caps the whole cluster's $/h; ``fit`` keeps only
    offers whose GPUs hold the model (memfit)."""
    offers = list(offers)
    ask = _resolve(resources, num_nodes, offers, providers=providers, unavailable=unavailable,
                   spot=spot, max_hourly_cost=max_hourly_cost, fit=fit)
    ranked, groups = _evaluate(offers, ask)
    rejected = [Rejection(k, reason, tuple(os_)) for (k, reason), os_ in groups.items()]
    rejected.sort(key=lambda r: (CONSTRAINTS.index(r.constraint), -r.count, r.reason))
    result = PlanResult(want=_want(ask, resources), ranked=ranked, rejected=rejected, memory=fit)
    if not ranked:
        result.suggestions = _suggest(offers, ask, {r.constraint for r in rejected})
    return result


def rank_task(task: Task, offers: Iterable[Offer], *, fit: MemoryEstimate | None = None,
              providers: Iterable[str] | None = None,
              unavailable: Mapping[str, str] | None = None) -> PlanResult:
    """``rank`` with the task's own market (use_spot) and budget (max_hourly_cost)."""
    res = task.resources
    return rank(res, task.num_nodes, offers, providers=providers, spot=res.use_spot,
                max_hourly_cost=res.max_hourly_cost, fit=fit, unavailable=unavailable)
