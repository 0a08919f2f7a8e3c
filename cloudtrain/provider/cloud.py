"""The base the cloud providers share (AWS, GCP, Azure; a third-party cloud may use it too).

:class:`CloudProvider` holds everything that is the same on every cloud, so that a cloud's
own modules say only what is its own (``placement.py``: its placement rules;
``provider.py``: how to find a region's zones, how to launch nodes in one zone, how its
network and teardown work):

- **placement hooks** (the :class:`~cloudtrain.provider.contract.Places` protocol): the
  cloud's offers, the regions its options allow, how an offer becomes a
  :class:`~cloudtrain.provider.contract.Target`. The placement step
  (``cloudtrain/pipeline/place.py``) ranks the offers once per launch and hands the ranked
  targets in on the request; this base never ranks.
- **the one failover loop**: :meth:`CloudProvider.create_nodes` walks the targets it was
  handed (``request.targets``, in order) and :meth:`CloudProvider.each_zone` the zones of
  one. Capacity errors move to the next zone, quota errors and :class:`Unavailable` to the
  next target, everything else (auth, throttling that retries did not cure, unexpected
  errors) stops at once. Nodes that exist pin the region, type and zone.
- **attempt records**: every attempt is an :class:`Attempt` with the same fields on every
  cloud (region, zone, instance_type, outcome, code, message, at), shown as it happens,
  kept in the cluster's record file and returned by ``attempts(cluster)``.
- zone/region name checks, the plan's placement and price notes, the owner mark of a
  cluster, the record file, the caller's CIDR, and the nodes as cloudtrain reaches them
  (:meth:`CloudProvider.node_at`).

A subclass sets the class attributes (``name``, ``title``, ``options_model``,
``shape_examples``, ``zone_re``/``region_re`` and their examples, ``exhausted_hint``,
``regions_hint``) and implements:

``find_existing(request) -> Existing``
    The cluster's nodes that exist (by rank), and where they are; removes duplicates.
``launch_target(request, target, pin, have) -> list[Node]``
    Makes the missing nodes in ``target``'s region, usually by calling :meth:`each_zone`
    with a function that launches in one zone. Raises :class:`Unavailable` when the region
    cannot run the request at all.
``ensure_network``, ``list_nodes``, ``terminate``, ``plan`` (with :meth:`plan_of`), and the
    gc verbs when it collects orphans.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, cast, get_args

from cloudtrain.provider import fabric
from cloudtrain.errors import (AuthError, CapacityError, CloudtrainError, ProviderError,
                               QuotaError, UserError, code_of)
from cloudtrain.ownership import default_owner, now, owner_of_cluster
from cloudtrain.provider.caller import CallerCidr, lookup_public_ip
from cloudtrain.provider.contract import (ClusterRequest, NetworkRef, Node, NodeStatus,
                                          Plan, ProviderContext, Target)
from cloudtrain.provider.failover import Attempt, Pin, Unavailable, outcome_of
from cloudtrain.provider.record import ClusterRecord

if TYPE_CHECKING:
    from pydantic import BaseModel

    from cloudtrain.catalog.model import Offer
    from cloudtrain.ui import UI

CIDR_LATER = "your public IP/32 (looked up when up runs)"


@dataclass(frozen=True)
class Existing:
    """What of a cluster exists: the cloud's record of each live node by rank, and where
    they are (the only target then) when there are any."""

    nodes: dict[int, Any] = field(default_factory=dict)
    where: Target | None = None
    zone: str | None = None


class CloudProvider:
    """The shared half of a cloud provider (see the module's docstring)."""

    name: ClassVar[str]
    title: ClassVar[str]
    """The cloud's name in messages: "AWS", "GCP", "Azure"."""
    options_model: ClassVar[type[BaseModel]]
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = False
    sdk_modules: ClassVar[tuple[str, ...]] = ()
    """The SDK modules the cloud's calls import (its extra: ``pip install 'cloudtrain[<name>]'``)."""
    shape_examples: ClassVar[tuple[str, str]]
    """(accelerators, instance_type) examples for the message when a task gives neither."""
    zone_re: ClassVar[re.Pattern[str] | None] = None
    """A zone name; group 1 is its region (None: zones are not named after regions)."""
    zone_example: ClassVar[tuple[str, str]] = ("", "")
    """(a zone, what a region's name is followed by in one of its zones)."""
    region_re: ClassVar[re.Pattern[str] | None] = None
    region_example: ClassVar[str] = ""
    exhausted_hint: ClassVar[str]
    regions_hint: ClassVar[str] = ""
    """The hint when the regions the task allows have no offer."""
    record_base: ClassVar[dict[str, Any]] = {}
    """What a new record file starts from."""

    default_poll: ClassVar[float] = 3.0
    default_running_timeout: ClassVar[float] = 600.0

    def __init__(self, ctx: ProviderContext, *, clients: Any = None,
                 caller_ip: Callable[[], str] | None = None,
                 offers: Callable[[], list[Offer]] | None = None,
                 sleep: Callable[[float], None] = time.sleep, owner: str | None = None,
                 ui: UI | None = None, poll: float | None = None) -> None:
        """``cls(ctx)`` is all cloudtrain calls; the rest is for tests and embedders:
        ``clients`` (the cloud's SDK client factory; default: the real one, with the
        standard credentials), ``caller_ip`` (this machine's public IP lookup), ``offers``
        (the catalog's offers of this cloud), ``sleep`` (every wait and backoff), ``owner``
        (the owner mark), ``ui`` (where progress and failover messages go), ``poll`` (seconds
        between looks while nodes start; how long they may take is the class's
        ``default_running_timeout``)."""
        self.ctx = ctx
        self.records = ClusterRecord(ctx, self.name)
        self.sleep = sleep
        self.poll = self.default_poll if poll is None else poll
        self.running_timeout = self.default_running_timeout
        self.owner = owner or default_owner(ctx.home)   # user@host/home-<this home's id>
        self.cidr = CallerCidr(ctx.home, caller_ip or lookup_public_ip)
        self._offers_fn = offers
        self._ui = ui
        self._attempts: dict[str, list[Attempt]] = {}
        self._network_began: set[str] = set()
        self._setup(clients)

    def _setup(self, clients: Any) -> None:
        """The cloud's own start: keep ``clients`` (or make the real factory), make caches."""

    # --- small helpers -----------------------------------------------------------------------

    @property
    def ui(self) -> UI:
        if self._ui is None:
            from cloudtrain.ui import UI

            self._ui = UI()
        return self._ui

    def _opts(self, request: ClusterRequest) -> Any:
        """The task's ``resources.<name>`` options (their defaults when it gives none)."""
        model = self.options_model
        return request.options if isinstance(request.options, model) else model()

    def _owner(self, cluster: str | None) -> str:
        """The owner mark of ``cluster``'s resources: this home's, or plain user@host for a
        cluster this home created before owner marks carried a home id."""
        return owner_of_cluster(self.records.read(cluster) if cluster else None, self.owner)

    def _record(self, cluster: str) -> dict[str, Any]:
        """The cluster's record file ({} when there is none): a hint, never the truth."""
        return self.records.read(cluster) or {}

    def _save(self, cluster: str, **updates: Any) -> None:
        self.records.update(cluster, self.record_base, **updates)

    def node_env(self, cluster: str) -> dict[str, str]:
        """The fast network's variables (``FI_PROVIDER``, ``NCCL_IB_HCA`` ...), recorded when
        the nodes were made; {} on the plain network. For bootstrap and every job."""
        return dict(self._record(cluster).get("fabric_env") or {})

    def _cidr_text(self, request: ClusterRequest) -> str:
        """The SSH rule's source for the plan: known now, or said to be looked up later."""
        return request.resources.ssh_cidr or self.cidr.cached() or CIDR_LATER

    # --- where to launch (the Places protocol: the placement step asks, and ranks) ---------

    def offers(self) -> list[Offer]:
        """The catalog's offers of this cloud (the ``offers`` given at construction, else
        the catalog in use)."""
        if self._offers_fn is not None:
            return list(self._offers_fn())
        from cloudtrain.catalog.load import provider_offers

        return provider_offers(self.ctx.home, self.name)

    def region_of(self, request: ClusterRequest) -> str | None:
        """The task's region: ``resources.region``, else the region of ``resources.zone``."""
        res = request.resources
        if res.region:
            return res.region
        m = self.zone_re.match(res.zone or "") if self.zone_re is not None else None
        return m.group(1) if m else None

    def wanted_regions(self, request: ClusterRequest, region: str | None) -> list[str]:
        """The regions the task allows, in its order ([]: any, in price order)."""
        return [region] if region else []

    def target_of(self, offer: Offer, price: float | None) -> Target:
        """The target for a catalog offer."""
        return Target(self.name, offer.region, offer.instance_type, price)

    def unpriced_target(self, request: ClusterRequest, region: str) -> Target:
        """The target for the task's own instance type where the catalog has no price."""
        return Target(self.name, region, str(request.resources.instance_type), None)

    def unlisted_targets(self, request: ClusterRequest, region: str | None,
                         offers: list[Offer]) -> list[Target]:
        """Targets when the catalog ranks nothing and the task allows any region."""
        return []

    def check_shape(self, request: ClusterRequest) -> None:
        """The task asks for GPUs or an instance type (a cloud cannot place it otherwise)."""
        res = request.resources
        if res.accelerators is None and not res.instance_type:
            gpus, itype = self.shape_examples
            raise UserError(f"The {self.title} provider needs resources.accelerators (e.g. "
                            f"{gpus}) or resources.instance_type (e.g. {itype}).",
                            "Add one of them to the task's resources.")

    def targets(self, request: ClusterRequest) -> list[Target]:
        """The targets this cloud was handed on the request, in the plan's order."""
        self.check_shape(request)
        mine = [t for t in request.targets if t.provider == self.name]
        if not mine:
            raise ProviderError(f"The request for '{request.name}' carries no {self.title} "
                                "target (the placement step decides them).",
                                "Plan the request first (cloudtrain.pipeline.place).")
        return mine

    # --- check and plan ----------------------------------------------------------------------

    def check_place(self, request: ClusterRequest) -> None:
        """``resources.region`` and ``zone`` are names of this cloud, the zone in the region."""
        res = request.resources
        if res.region and self.region_re is not None and not self.region_re.match(res.region):
            raise UserError(f"resources.region '{res.region}' is not a {self.title} region "
                            "name.", f"Write e.g. {self.region_example}.")
        if res.zone and self.zone_re is not None:
            m = self.zone_re.match(res.zone)
            zone, suffix = self.zone_example
            if not m:
                raise UserError(f"resources.zone '{res.zone}' is not a {self.title} zone name.",
                                f"Write e.g. {zone} (or leave it out to try every zone).")
            if res.region and m.group(1) != res.region:
                raise UserError(f"resources.zone {res.zone} is not in region {res.region}.",
                                f"Use a zone of {res.region}, e.g. {res.region}{suffix}.")

    def plan_of(self, request: ClusterRequest, targets: list[Target], creates: list[str],
                notes: list[str]) -> Plan:
        """The plan of ``up`` on ``targets[0]``: the cloud's ``creates`` and ``notes``, then
        where it tries (zones, the next regions) and a missing price."""
        res, first = request.resources, targets[0]
        zone_note = f"zone {res.zone}" if res.zone else (
            f"the zones of {first.region} in turn"
            + (f" ({', '.join(first.zones)})" if first.zones else ""))
        more = ", ".join(f"{t.region} ({t.instance_type}"
                         + (f", ${t.price:.2f}/h per node)" if t.price is not None else ")")
                         for t in targets[1:4])
        notes.append(f"placement: {zone_note}" + (f"; then {more}" + (", ..." if len(targets) > 4
                                                                      else "") if more else ""))
        if first.price is None:
            notes.append(f"the catalog has no {'spot' if res.use_spot else 'on-demand'} price "
                         f"for {first.instance_type} in {first.region}")
        accel = str(res.accelerators) if res.accelerators else None
        network = fabric.describe(res.network, self.name, first.instance_type, request.num_nodes)
        return Plan(provider=self.name, num_nodes=request.num_nodes, region=first.region,
                    zone=res.zone, instance_type=first.instance_type, accelerators=accel,
                    use_spot=res.use_spot, hourly_price_per_node=first.price, network=network,
                    creates=creates, notes=notes)

    # --- attempts ----------------------------------------------------------------------------

    def where(self, region: str, zone: str | None) -> str:
        """A place in messages: the zone (its name says the region), else the region."""
        return zone or region

    def begin_attempts(self, cluster: str) -> None:
        """An ``up`` starts (``ensure_network``): its attempts start afresh."""
        self._attempts[cluster] = []
        self._network_began.add(cluster)

    def record_attempt(self, cluster: str, region: str, zone: str | None, instance_type: str,
                       outcome: str, err: BaseException | str) -> None:
        """Record one placement attempt (``err``: the error, or the reason in words) and
        show it when it failed."""
        code = err if isinstance(err, str) else code_of(err)
        msg = err if isinstance(err, str) else (
            err.message if isinstance(err, CloudtrainError) else str(err))
        self._attempts.setdefault(cluster, []).append(
            Attempt(region, zone, instance_type, outcome, code, msg, now()))
        if outcome != "ok":
            self.ui.warn(f"{self.name} {self.where(region, zone)} ({instance_type}): {outcome}: "
                         f"{code}" + (f" - {msg}" if msg and msg != code else ""))

    def attempts(self, cluster: str) -> list[dict[str, Any]]:
        """Every placement attempt of the last ``up`` and its outcome, in order."""
        tried = self._attempts.get(cluster)
        return [a.as_dict() for a in (self.records.note(cluster).attempts if tried is None
                                      else tried)]

    def exhausted(self, request: ClusterRequest, why: str = "no region to try"
                  ) -> ProviderError:
        """The error when no target could place the request: every failed attempt named;
        a quota error when all of them were quota or unavailable, else a capacity error."""
        tried = [a for a in self._attempts.get(request.name, []) if a.outcome != "ok"]
        res = request.resources
        what = (f"{request.num_nodes} x {res.instance_type or res.accelerators} "
                f"({'spot' if res.use_spot else 'on-demand'})")
        lines = "; ".join(f"{self.where(a.region, a.zone)}: {a.code}" for a in tried) or why
        cls: type[ProviderError] = QuotaError if tried and all(
            a.outcome in ("quota", "unavailable") for a in tried) else CapacityError
        return cls(f"{self.title} could not place {what} after {len(tried)} attempt(s): "
                   f"{lines}.", self.exhausted_hint)

    # --- the failover loop -------------------------------------------------------------------

    def find_existing(self, request: ClusterRequest) -> Existing:
        """The cluster's nodes that exist (by rank) and where they are; removes duplicates.
        Each cloud implements it."""
        raise NotImplementedError

    def launch_target(self, request: ClusterRequest, target: Target, pin: Pin | None,
                      have: dict[int, Any]) -> list[Node]:
        """Make the missing nodes (ranks not in ``have``) in ``target``'s region, usually
        through :meth:`each_zone`; only ``pin``'s zone when given. Raises
        :class:`Unavailable` when the region cannot run the request at all. Each cloud
        implements it."""
        raise NotImplementedError

    def check_ranks(self, request: ClusterRequest, ranks: Iterable[int]) -> None:
        """Refuse a cluster that has more nodes than the task asks for."""
        too_many = sorted(r for r in ranks if r >= request.num_nodes)
        if too_many:
            name = request.name
            raise UserError(f"{self.title} cluster '{name}' has node(s) of rank up to "
                            f"{too_many[-1]}; the task asks for {request.num_nodes} node(s).",
                            f"Take it down first ('cloudtrain down {name}') or use another "
                            "name.")

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        """Adopt what exists, then make what is missing: the targets handed in on the
        request in turn, the zones of each in turn (:meth:`each_zone`), every attempt
        recorded. Nodes that exist pin their target and zone."""
        name = request.name
        if name not in self._network_began:
            self._attempts[name] = []
        self._network_began.discard(name)
        self._attempts.setdefault(name, [])
        have = self.find_existing(request)
        pin: Pin | None
        if have.where is not None:   # the nodes that exist pin the region, type and zone
            targets, pin = [have.where], Pin(have.zone)
        else:
            zone = request.resources.zone
            targets, pin = self.targets(request), (Pin(zone) if zone else None)
        for target in targets:
            if any(a.region == target.region and a.outcome in ("quota", "unavailable")
                   for a in self._attempts[name]):
                continue
            nodes = self._try(request, target, pin, have.nodes)
            if nodes is not None:
                return nodes
        raise self.exhausted(request)

    def _try(self, request: ClusterRequest, target: Target, pin: Pin | None,
             have: dict[int, Any]) -> list[Node] | None:
        """One target: its nodes, or None (recorded) when the next target is to be tried."""
        name = request.name
        try:
            return self.launch_target(request, target, pin, have)
        except Unavailable as exc:
            self.record_attempt(name, target.region, None, target.instance_type,
                                "unavailable", str(exc))
        except QuotaError as exc:
            self.record_attempt(name, target.region, exc.zone, target.instance_type, "quota",
                                exc)
        except CapacityError:
            pass   # each zone's attempt is recorded already
        finally:
            self._save(name, attempts=[a.as_dict() for a in self._attempts[name]])
        return None

    def each_zone(self, request: ClusterRequest, target: Target, zones: list[Any],
                  launch: Callable[[Any], list[Node]], *,
                  skip: Callable[[Any], str | None] | None = None,
                  none_left: str = "no zone to try") -> list[Node]:
        """Launch in ``zones`` in turn until one has room: capacity moves on to the next
        zone; quota (the region's) and anything else end the region. ``skip(zone)`` gives a
        reason not to try a zone; ``none_left``: the :class:`Unavailable` reason when no
        zone could even be tried."""
        name, region, itype = request.name, target.region, target.instance_type
        last: ProviderError | None = None
        for zone in zones:
            why = skip(zone) if skip is not None else None
            if why:
                self.record_attempt(name, region, zone, itype, "unavailable", why)
                continue
            try:
                nodes = launch(zone)
            except CapacityError as exc:
                self.record_attempt(name, region, zone, itype, "capacity", exc)
                last = exc
                continue
            except QuotaError as exc:
                if exc.zone is not None:
                    raise
                raise QuotaError(exc.message, exc.hint, code=exc.code, zone=zone) from exc
            except ProviderError as exc:
                self.record_attempt(name, region, zone, itype, outcome_of(exc), exc)
                raise
            self.record_attempt(name, region, zone, itype, "ok", "launched")
            return nodes
        if last is not None:
            raise last
        raise Unavailable(none_left)

    # --- teardown and gc -------------------------------------------------------------------

    def remove_each(self, items: list[Any], remove: Callable[[Any], object], *,
                    label: Callable[[Any], str], failed: str, hint: str,
                    workers: int = 1) -> None:
        """``remove(item)`` for each item (``workers`` at a time; what it returns is
        ignored): credentials errors stop at once; other provider errors are gathered into
        one error (``failed``, then each ``label(item)`` and its message) once every item
        was tried."""
        def one(item: Any) -> str | None:
            try:
                remove(item)
            except AuthError:
                raise
            except ProviderError as exc:
                return f"{label(item)}{exc.message}"
            return None

        if not items:
            return
        if workers > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
                problems = [p for p in pool.map(one, items) if p]
        else:
            problems = [p for p in map(one, items) if p]
        if problems:
            raise ProviderError(failed + " | ".join(problems), hint)

    # --- nodes as cloudtrain sees them -------------------------------------------------------

    @staticmethod
    def node_at(*, rank: int, instance_id: str, address: str, private: str, user: str,
                status: str, spot: bool, host_keys: tuple[str, ...] = ()) -> Node:
        """A node as cloudtrain reaches it: at ``address`` (its public or private one, as
        the task says; through ``resources.ssh_proxy`` when the task names one), port 22,
        as ``user``, its files under ``~/cloudtrain``; the other nodes reach it at
        ``private``. A ``status`` that is not a :data:`NodeStatus` is ``unknown``."""
        known = cast(NodeStatus, status) if status in get_args(NodeStatus) else "unknown"
        return Node(rank=rank, instance_id=instance_id, host=address, port=22, user=user,
                    internal_ip=private, status=known, host_keys=host_keys,
                    root_dir="cloudtrain", spot=spot)

    def _login(self, cluster: str, default_user: str) -> tuple[str, bool]:
        """(the nodes' login user, whether they are reached at their public address), as
        the cluster's record says."""
        rec = self._record(cluster)
        return str(rec.get("user") or default_user), bool(rec.get("public_ip", True))


__all__ = ["CloudProvider", "Existing"]
