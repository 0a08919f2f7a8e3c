"""The GCP provider: the contract of :mod:`cloudtrain.provider` on Compute Engine.

Where it launches: ``resources.region`` (and ``zone``) when given; otherwise the regions the
catalog prices the machine in, cheapest first (``resources.gcp.regions`` narrows and orders
them). Within a region the zones that offer the shape are tried in turn (the catalog's zones
for the offer, ``resources.gcp.zones``, or every zone of the region); a multi-node cluster
always stays in one zone. Capacity errors (ZONE_RESOURCE_POOL_EXHAUSTED,
..._WITH_DETAILS, UNSUPPORTED_OPERATION: GCE reports them in the insert's finished
operation) move to the next zone, QUOTA_EXCEEDED to the next region, permission errors stop
at once with the fix, passing faults are retried with backoff. Every attempt and its reason
is kept (``attempts(cluster)``, the cluster's ``gcp.json``) and shown as it happens. What a
failed multi-node attempt got is deleted before the next zone is tried.

What it remembers locally is only a hint (``$CLOUDTRAIN_HOME/clusters/<name>/gcp.json``:
the project, written before anything is created, and the zone, attempts and login). The
truth is the labels: ``down`` and ``gc`` work without the hint (in the default project).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel

from cloudtrain.provider import failover
from cloudtrain.provider.addrmap import AddressMap
from cloudtrain.provider.caller import CallerCidr, lookup_public_ip
from cloudtrain.provider.record import ClusterRecord
from cloudtrain.errors import AuthError, CapacityError, ProviderError, QuotaError, UserError
from cloudtrain.ownership import owner_of_cluster
from cloudtrain.provider import ClusterRequest, NetworkRef, Node, Plan, ProviderContext

from . import images as IMG
from . import instances as I
from . import labels as L
from . import network as NET
from . import teardown as TD
from .api import Api, GoogleClients, code_of
from .options import REGION_RE, ZONE_RE, GCPOptions

if TYPE_CHECKING:
    from cloudtrain.catalog.model import Offer
    from cloudtrain.ui import UI

RECORD = "gcp.json"
DEFAULT_REGION = "us-central1"
_FROM_ENV: Any = object()


@dataclass(frozen=True)
class Target:
    """One region to try: the machine type there, the GPUs to attach (N1; None when there
    are none or they come with the machine), its price and the zones the catalog lists."""

    region: str
    machine_type: str
    accelerator: str | None
    count: int
    price: float | None
    zones: tuple[str, ...] = ()


class _Unavailable(Exception):
    """This region cannot run the request at all (shape not offered): try the next."""


class GCPProvider:
    name: ClassVar[str] = "gcp"
    options_model: ClassVar[type[BaseModel] | None] = GCPOptions
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = False

    def __init__(self, ctx: ProviderContext, *, clients: GoogleClients | None = None,
                 caller_ip: Callable[[], str] | None = None,
                 offers: Callable[[], list[Offer]] | None = None,
                 sleep: Callable[[float], None] = time.sleep, owner: str | None = None,
                 ui: UI | None = None, address_map: AddressMap | None = _FROM_ENV,
                 poll: float = 3.0, running_timeout: float = 600.0) -> None:
        self.ctx = ctx
        self.records = ClusterRecord(ctx, self.name)
        self._clients = clients
        self._factories: dict[str, GoogleClients] = {}
        self._apis: dict[int, Api] = {}
        self.sleep = sleep
        self.poll = poll
        self.running_timeout = running_timeout
        self.owner = owner or L.default_owner(ctx.home)   # user@host/home-<this home's id>
        self.cidr = CallerCidr(ctx.home, caller_ip or lookup_public_ip)
        self._offers_fn = offers
        self._ui = ui
        self.amap = AddressMap.from_env("gcp") if address_map is _FROM_ENV else address_map
        self._attempts: dict[str, list[dict[str, Any]]] = {}
        self._images: dict[tuple[str, str | None, str, str | None], IMG.Image] = {}

    # --- small helpers ---------------------------------------------------------------------

    @property
    def ui(self) -> UI:
        if self._ui is None:
            from cloudtrain.ui import UI

            self._ui = UI()
        return self._ui

    @staticmethod
    def _opts(request: ClusterRequest) -> GCPOptions:
        return request.options if isinstance(request.options, GCPOptions) else GCPOptions()

    def _factory(self, credentials_file: str | None) -> GoogleClients:
        if self._clients is not None:
            return self._clients
        key = credentials_file or ""
        if key not in self._factories:
            self._factories[key] = GoogleClients(credentials_file=credentials_file)
        return self._factories[key]

    def _api(self, credentials_file: str | None = None) -> Api:
        f = self._factory(credentials_file)
        api = self._apis.get(id(f))
        if api is None:
            api = Api(f, sleep=self.sleep)
            self._apis[id(f)] = api
        return api

    @property
    def api(self) -> Api:
        """The API with the default credentials (tests look at its retry delays)."""
        return self._api(None)

    @staticmethod
    def owner_mark(owner: str) -> str:
        """``owner`` as GCE stores it (a label value): what gc compares marks with."""
        return L.owner_value(owner)

    def _owner(self, cluster: str | None) -> str:
        """The owner mark of ``cluster``'s resources: this home's, or plain user@host for a
        cluster this home created before owner marks carried a home id."""
        return owner_of_cluster(self.records.read(cluster) if cluster else None, self.owner)

    def _record_file(self, cluster: str) -> Path:
        return self.records.path(cluster)

    def _record(self, cluster: str) -> dict[str, Any] | None:
        return self.records.read(cluster)

    def _save(self, cluster: str, **updates: Any) -> None:
        self.records.update(cluster, {}, **updates)

    def _request_api(self, request: ClusterRequest) -> tuple[Api, str]:
        opts = self._opts(request)
        api = self._api(opts.credentials_file)
        return api, api.clients.project(opts.project)

    def _cluster_api(self, cluster: str) -> tuple[Api, str]:
        """The API and project of an existing cluster: from its record, else the defaults."""
        rec = self._record(cluster) or {}
        api = self._api(rec.get("credentials_file"))
        return api, api.clients.project(rec.get("project"))

    def _offers(self) -> list[Offer]:
        if self._offers_fn is not None:
            return list(self._offers_fn())
        from cloudtrain.catalog.load import provider_offers

        return provider_offers(self.ctx.home, self.name)

    # --- where to launch -----------------------------------------------------------------

    @staticmethod
    def _region_of(request: ClusterRequest) -> str | None:
        res = request.resources
        if res.region:
            return res.region
        m = ZONE_RE.match(res.zone or "")
        return m.group(1) if m else None

    def targets(self, request: ClusterRequest) -> list[Target]:
        """The regions to try, in order, each with its machine type and price. Creates
        nothing and calls nothing (the catalog is local)."""
        from cloudtrain import planner

        res, opts = request.resources, self._opts(request)
        if res.accelerators is None and not res.instance_type:
            raise UserError("The GCP provider needs resources.accelerators (e.g. T4:1, A100:8) "
                            "or resources.instance_type (e.g. a2-highgpu-8g).",
                            "Add one of them to the task's resources.")
        region = self._region_of(request)
        wanted = [region] if region else list(opts.regions) or list(dict.fromkeys(
            ZONE_RE.match(z).group(1) for z in opts.zones))  # type: ignore[union-attr]
        acc = res.accelerators
        result = planner.rank(res.model_copy(update={"provider": "gcp", "zone": None,
                                                     "region": region}),
                              request.num_nodes, self._offers(), spot=res.use_spot,
                              max_hourly_cost=res.max_hourly_cost)
        best: dict[str, Target] = {}
        for r in result.ranked:
            o = r.offer
            if o.region in best or (wanted and o.region not in wanted):
                continue
            attach = None
            if o.accelerator and not IMG.builtin_gpus(o.instance_type):
                attach = o.accelerator
            best[o.region] = Target(o.region, o.instance_type, attach,
                                    int(o.accelerator_count) if attach else 0, r.per_node,
                                    tuple(o.zones))
        if wanted:
            out = [best[w] for w in wanted if w in best]
            if res.instance_type:  # types the catalog does not price still run
                attach = acc.name if acc and not IMG.builtin_gpus(res.instance_type) else None
                out = [best.get(w) or Target(w, res.instance_type, attach,
                                             acc.count if attach and acc else 0, None)
                       for w in wanted]
        else:
            out = list(best.values())
            if not out and res.instance_type:
                attach = acc.name if acc and not IMG.builtin_gpus(res.instance_type) else None
                out = [Target(DEFAULT_REGION, res.instance_type, attach,
                              acc.count if attach and acc else 0, None)]
        if not out:
            raise result.error() if not result.ranked else UserError(
                f"No offer for {result.want} in {', '.join(wanted)}.",
                "Drop resources.gcp.regions/zones, or list regions the catalog prices it in.")
        return out

    def _zones(self, api: Api, project: str, request: ClusterRequest, target: Target,
               pinned: str | None) -> list[str]:
        if pinned:
            return [pinned]
        opts = self._opts(request)
        if opts.zones:
            return [z for z in opts.zones if z.startswith(target.region + "-")]
        if target.zones:
            return [z for z in target.zones if z.startswith(target.region + "-")]
        return IMG.region_zones(api, project, target.region)

    # --- contract: check and plan ----------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        res, opts = request.resources, self._opts(request)
        if res.region and not REGION_RE.match(res.region):
            raise UserError(f"resources.region '{res.region}' is not a GCP region name.",
                            "Write e.g. us-central1.")
        if res.zone:
            m = ZONE_RE.match(res.zone)
            if not m:
                raise UserError(f"resources.zone '{res.zone}' is not a GCP zone name.",
                                "Write e.g. us-central1-a (or leave it out to try every zone).")
            if res.region and m.group(1) != res.region:
                raise UserError(f"resources.zone {res.zone} is not in region {res.region}.",
                                f"Use a zone of {res.region}, e.g. {res.region}-a.")
        region = self._region_of(request)
        if region and opts.zones and not any(z.startswith(region + "-") for z in opts.zones):
            raise UserError(f"resources.gcp.zones lists no zone of region {region}.",
                            f"List zones of {region}, or drop resources.gcp.zones.")
        if opts.subnetwork and not opts.network:
            raise UserError("resources.gcp.subnetwork is given without resources.gcp.network.",
                            "Name the network the subnetwork belongs to in "
                            "resources.gcp.network, or drop the subnetwork (cloudtrain then "
                            "creates a network of the cluster's own).")
        if opts.credentials_file and not Path(opts.credentials_file).expanduser().is_file():
            raise UserError(f"resources.gcp.credentials_file {opts.credentials_file} does not "
                            "exist.", "Give the path of a service-account key file (JSON).")
        for t in self.targets(request):
            if t.accelerator:
                IMG.accelerator_type(t.accelerator)

    def plan(self, request: ClusterRequest) -> Plan:
        res, opts = request.resources, self._opts(request)
        targets = self.targets(request)
        first = targets[0]
        base = L.base_name(request.name, self._owner(request.name))
        cidr = res.ssh_cidr or self.cidr.cached() or "your public IP/32 (looked up when up runs)"
        project = opts.project or "the default project (GOOGLE_CLOUD_PROJECT or the credentials')"
        net = opts.network or NET.dedicated_name(base)
        creates = ([] if opts.network else
                   [f"VPC network {net} (auto-mode, the cluster's own; deleted at teardown)"])
        creates += [f"firewall rule {r.name(base)} on network {net}: {r.text(base)}"
                    for r in NET.desired_rules(base, cidr, list(res.ports))]
        market = ("spot (provisioningModel SPOT, termination action DELETE)" if res.use_spot
                  else "on-demand")
        gpus = (f" + {first.count} x {IMG.accelerator_type(first.accelerator)} attached"
                if first.accelerator else "")
        image = IMG.describe_choice(res.image, opts.image_project, opts.image_family)
        disk = opts.disk_type or IMG.default_disk_type(first.machine_type)
        maint = ("TERMINATE" if first.accelerator or IMG.builtin_gpus(first.machine_type)
                 or res.use_spot else "MIGRATE")
        creates.append(
            f"{request.num_nodes} x {first.machine_type}{gpus} {market} instance(s) "
            f"{base}-0..{request.num_nodes - 1}, one zone: {image}; {res.disk_size_gb} GB "
            f"{disk} boot disk, deleted with the instance; onHostMaintenance {maint}; "
            f"network tag {base}; the cluster's SSH key in instance metadata (user "
            f"{opts.ssh_user})" + ("; no external IP" if not opts.public_ip else ""))
        notes = [f"project: {project}",
                 f"every instance and boot disk is labelled {L.CLUSTER}={request.name}, "
                 f"{L.OWNER}={L.owner_value(self._owner(request.name))}, {L.RANK}; the firewall rules carry "
                 "the same marks in their description"]
        zone_note = (f"zone {res.zone}" if res.zone else
                     f"the zones of {first.region} in turn"
                     + (f" ({', '.join(first.zones)})" if first.zones else ""))
        more = ", ".join(f"{t.region} ({t.machine_type}"
                         + (f", ${t.price:.2f}/h per node)" if t.price is not None else ")")
                         for t in targets[1:4])
        notes.append(f"placement: {zone_note}" + (f"; then {more}" + (", ..." if len(targets) > 4
                                                                      else "") if more else ""))
        if first.price is None:
            notes.append(f"the catalog has no {'spot' if res.use_spot else 'on-demand'} price "
                         f"for {first.machine_type} in {first.region}")
        accel = str(res.accelerators) if res.accelerators else None
        return Plan(provider="gcp", num_nodes=request.num_nodes, region=first.region,
                    zone=res.zone, instance_type=first.machine_type, accelerators=accel,
                    use_spot=res.use_spot, hourly_price_per_node=first.price, creates=creates,
                    notes=notes)

    # --- contract: network ---------------------------------------------------------------

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        res, opts = request.resources, self._opts(request)
        api, project = self._request_api(request)
        owner = self._owner(request.name)
        base = L.base_name(request.name, owner)
        network = opts.network or NET.dedicated_name(base)
        before = (self._record(request.name) or {}).get("network")
        if not opts.network and before and not str(before).startswith("ct-"):
            # made by an earlier cloudtrain on a shared network: its nodes are not on ours
            raise UserError(f"GCP cluster '{request.name}' was created on network '{before}'; "
                            "cloudtrain now gives each cluster a network of its own.",
                            f"Take it down ('cloudtrain down {request.name}') and bring it up "
                            "again, or keep it where it is with resources.gcp.network: "
                            f"{before} (checked for rules wider than cloudtrain's).")
        # Written before anything is created: teardown looks in this project.
        self._save(request.name, project=project, network=network,
                   credentials_file=opts.credentials_file)
        cidr = self.cidr.get(res.ssh_cidr)
        if opts.network:
            NET.check_network(api, project, opts.network)
            NET.audit_network(api, project, opts.network, base, cidr, list(res.ports),
                              opts.service_account)
        else:
            NET.ensure_dedicated_network(api, project, base, request.name, owner)
        rules = NET.desired_rules(base, cidr, list(res.ports))
        NET.ensure_firewalls(api, project, network, base, request.name, owner, rules)
        self._save(request.name, ssh_cidr=cidr)
        return NetworkRef(f"{project}/{network}",
                          f"firewall rules on network {network} ({project}): "
                          + "; ".join(f"{r.name(base)}: {r.text(base)}" for r in rules))

    # --- contract: nodes -----------------------------------------------------------------

    def _attempt(self, cluster: str, region: str, zone: str | None, mtype: str, outcome: str,
                 err: BaseException | str) -> None:
        code = err if isinstance(err, str) else code_of(err)
        msg = err if isinstance(err, str) else getattr(err, "message", str(err))
        a = {"region": region, "zone": zone, "instance_type": mtype, "outcome": outcome,
             "code": code, "message": msg, "at": L.now()}
        self._attempts.setdefault(cluster, []).append(a)
        if outcome != "ok":
            self.ui.warn(f"gcp {zone or region} ({mtype}): {outcome}: {code}"
                         + (f" - {msg}" if msg and msg != code else ""))

    def attempts(self, cluster: str) -> list[dict[str, Any]]:
        """Every placement attempt of the last ``up`` and its outcome, in order."""
        if cluster in self._attempts:
            return list(self._attempts[cluster])
        return list((self._record(cluster) or {}).get("attempts", []))

    def _scan(self, api: Api, project: str, cluster: str) -> tuple[list[I.Inst], list[I.Inst]]:
        """(live: one per rank, the oldest when a rank somehow has two, in rank order;
        duplicates and instances without a rank)."""
        every = I.describe(api, project, cluster, self._owner(cluster))
        by_rank: dict[int, I.Inst] = {}
        dups = []
        for i in sorted(every, key=lambda i: (i.created_at, i.id)):
            if i.rank is not None and i.rank not in by_rank:
                by_rank[i.rank] = i
            else:
                dups.append(i)
        return [by_rank[r] for r in sorted(by_rank)], dups

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        name, n = request.name, request.num_nodes
        api, project = self._request_api(request)
        self._attempts[name] = []
        live, dups = self._scan(api, project, name)
        too_many = [i for i in live if i.rank is not None and i.rank >= n]
        if too_many:
            raise UserError(f"GCP cluster '{name}' has node(s) of rank up to {too_many[-1].rank}; "
                            f"the task asks for {n} node(s).",
                            f"Take it down first ('cloudtrain down {name}') or use another name.")
        if dups:
            self.ui.warn(f"gcp: deleting {len(dups)} duplicate instance(s) of '{name}': "
                         + ", ".join(i.name for i in dups))
            by_zone: dict[str, list[str]] = {}
            for i in dups:
                by_zone.setdefault(i.zone, []).append(i.name)
            I.delete(api, project, by_zone)
        if live:
            first = live[0]
            acc = request.resources.accelerators
            attach = acc.name if acc and not IMG.builtin_gpus(first.machine_type) else None
            targets = [Target(first.region, first.machine_type, attach,
                              acc.count if attach and acc else 0, None)]
            pinned: str | None = first.zone
        else:
            targets = self.targets(request)
            pinned = request.resources.zone
        have = {int(i.rank): i for i in live if i.rank is not None}
        for target in targets:
            if any(a["region"] == target.region and a["outcome"] in ("quota", "unavailable")
                   for a in self._attempts[name]):
                continue
            try:
                nodes = self._try_region(api, project, request, target, pinned, have)
            except _Unavailable as exc:
                self._attempt(name, target.region, None, target.machine_type, "unavailable",
                              str(exc))
                continue
            except QuotaError as exc:
                self._attempt(name, target.region, getattr(exc, "zone", None),
                              target.machine_type, "quota", exc)
                continue
            except CapacityError:
                continue   # each zone's attempt is recorded already
            finally:
                self._save(name, attempts=self._attempts[name])
            return nodes
        raise self._exhausted(request)

    def _exhausted(self, request: ClusterRequest) -> ProviderError:
        tried = [a for a in self._attempts.get(request.name, []) if a["outcome"] != "ok"]
        market = "spot" if request.resources.use_spot else "on-demand"
        what = (f"{request.num_nodes} x "
                f"{request.resources.instance_type or request.resources.accelerators} ({market})")
        lines = "; ".join(f"{a['zone'] or a['region']}: {a['code']}" for a in tried) or "none"
        cls: type[ProviderError] = QuotaError if tried and all(
            a["outcome"] in ("quota", "unavailable") for a in tried) else CapacityError
        return cls(f"GCP could not place {what} after {len(tried)} attempt(s): {lines}.",
                   "Try later, another region (resources.region, resources.gcp.regions) or "
                   "machine type, or the other market (use_spot); for quotas, ask for more "
                   "under IAM & Admin > Quotas in the GCP console.")

    def _image(self, api: Api, project: str, request: ClusterRequest) -> IMG.Image:
        res, opts = request.resources, self._opts(request)
        key = (project, res.image, opts.image_project, opts.image_family)
        if key not in self._images:
            self._images[key] = IMG.find_image(api, res.image, opts.image_project,
                                               opts.image_family)
        return self._images[key]

    def _try_region(self, api: Api, project: str, request: ClusterRequest, target: Target,
                    pinned: str | None, have: dict[int, I.Inst]) -> list[Node]:
        name = request.name
        region, mtype = target.region, target.machine_type
        zones = self._zones(api, project, request, target, pinned)
        if not zones:
            raise _Unavailable(f"no zone of {region} to try")
        missing = [r for r in range(request.num_nodes) if r not in have]
        image = None
        if missing:
            image = self._image(api, project, request)
            IMG.check_disk(image, request.resources.disk_size_gb)
        accel = IMG.accelerator_type(target.accelerator) if target.accelerator else None
        last: ProviderError | None = None
        for zone in zones:
            why = IMG.offered_in_zone(api, project, zone, mtype, accel) if missing else None
            if why:
                self._attempt(name, region, zone, mtype, "unavailable", why)
                continue
            try:
                nodes = self._launch_zone(api, project, request, target, image, zone, missing,
                                          have)
            except CapacityError as exc:
                self._attempt(name, region, zone, mtype, "capacity", exc)
                last = exc
                continue
            except QuotaError as exc:
                exc.zone = zone  # type: ignore[attr-defined]
                raise
            except ProviderError as exc:
                self._attempt(name, region, zone, mtype, failover.outcome_of(exc), exc)
                raise
            self._attempt(name, region, zone, mtype, "ok", "launched")
            return nodes
        if last is not None:
            raise last
        raise _Unavailable(f"no zone of {region} offers {mtype}"
                           + (f" with {accel}" if accel else ""))

    def _launch_zone(self, api: Api, project: str, request: ClusterRequest, target: Target,
                     image: IMG.Image | None, zone: str, missing: list[int],
                     have: dict[int, I.Inst]) -> list[Node]:
        res, opts = request.resources, self._opts(request)
        new: dict[int, str] = {}
        if missing:
            assert image is not None
            owner = self._owner(request.name)
            base = L.base_name(request.name, owner)
            spec = I.LaunchSpec(
                project=project, zone=zone, base=base,
                machine_type=target.machine_type, accelerator=target.accelerator,
                accelerator_count=target.count, image=image, disk_gb=res.disk_size_gb,
                disk_type=opts.disk_type or IMG.default_disk_type(target.machine_type),
                cluster=request.name, owner=owner, spot=res.use_spot,
                network=opts.network or NET.dedicated_name(base),
                subnetwork=opts.subnetwork, public_ip=opts.public_ip,
                ssh_user=opts.ssh_user, public_key=request.public_key,
                service_account=opts.service_account, install_driver=opts.install_nvidia_driver)
            new, errors = I.launch(api, spec, missing)
            if errors:
                self._rollback(api, project, zone, list(new.values()))
                raise failover.worst(list(errors.values()))
        stopped = [i.name for i in have.values() if i.status == "TERMINATED"]
        try:
            if stopped:
                I.start(api, project, zone, stopped)
            names = [i.name for i in have.values()] + list(new.values())
            running = I.wait_running(api, project, zone, names, need_public=opts.public_ip,
                                     sleep=self.sleep, poll=self.poll,
                                     timeout=self.running_timeout)
            self._save(request.name, region=target.region, zone=zone,
                       machine_type=target.machine_type, user=opts.ssh_user,
                       public_ip=opts.public_ip)
            if self.amap is not None:
                self.amap.wait_for([a for i in running for a in (i.nat_ip, i.internal_ip) if a])
            keys = self._host_keys(api, project, zone, [i.name for i in running],
                                   opts.host_key_wait)
            self._save(request.name, host_keys={**((self._record(request.name) or {})
                                                   .get("host_keys") or {}),
                                                **{k: list(v) for k, v in keys.items()}})
            return [self._node(i, opts.ssh_user, opts.public_ip, keys.get(i.name, ()))
                    for i in running]
        except BaseException:
            self._rollback(api, project, zone, list(new.values()))
            raise

    def _rollback(self, api: Api, project: str, zone: str, names: list[str]) -> None:
        """Delete the instances this attempt made (the ones it adopted are left alone)."""
        if names:
            self.ui.warn(f"gcp: deleting the {len(names)} node(s) this attempt got in {zone}: "
                         + ", ".join(names))
            I.delete(api, project, {zone: names})

    def _host_keys(self, api: Api, project: str, zone: str, names: list[str],
                   wait: float) -> dict[str, tuple[str, ...]]:
        """Each node's host keys from its guest attributes, waiting up to ``wait`` seconds
        (of polling) for the guest agent to publish them. A node still without keys then is
        learned on first contact, and said so."""
        found: dict[str, tuple[str, ...]] = {}
        if wait <= 0 or not names:
            return found
        waited, step = 0.0, 2.0
        while True:
            try:
                for n in names:
                    if n not in found:
                        keys = I.host_keys(api, project, zone, n)
                        if keys:
                            found[n] = keys
            except ProviderError as exc:
                # e.g. no compute.instances.getGuestAttributes permission: not fatal, the
                # keys are then learned on first contact (and status says so)
                self.ui.warn(f"gcp: cannot read the nodes' host keys from their guest "
                             f"attributes ({exc.message}).")
                break
            if len(found) == len(names) or waited >= wait:
                break
            self.sleep(step)
            waited += step
        missing = [n for n in names if n not in found]
        if missing:
            self.ui.warn(f"gcp: {', '.join(missing)} published no SSH host key in its guest "
                         f"attributes within {wait:.0f} s; its key is learned on first contact.")
        return found

    def _node(self, i: I.Inst, user: str, public: bool,
              host_keys: tuple[str, ...] = ()) -> Node:
        addr = i.nat_ip if public else i.internal_ip
        status = I.STATUS.get(i.status, "unknown")
        iid = f"{i.name}/{i.id}" if i.id else i.name
        rank = int(i.rank or 0)
        if self.amap is None:
            return Node(rank=rank, instance_id=iid, host=addr, port=22, user=user,
                        internal_ip=i.internal_ip, status=status,  # type: ignore[arg-type]
                        root_dir="cloudtrain", spot=i.spot, host_keys=host_keys)
        # Test mode: only addresses the map gives are ever used.
        if not addr:
            return Node(rank=rank, instance_id=iid, host="", user=user,
                        status=status, spot=i.spot)  # type: ignore[arg-type]
        what = f"node {i.rank} ({i.name})"
        t = self.amap.resolve(addr, what)
        inner = self.amap.resolve(i.internal_ip, what).host if i.internal_ip else t.host
        return Node(rank=rank, instance_id=iid, host=t.host, port=t.port,
                    user=str(self.amap.setting("user") or user), internal_ip=inner,
                    status=status, root_dir=t.root_dir or "cloudtrain",  # type: ignore[arg-type]
                    spot=i.spot, host_keys=host_keys)

    def list_nodes(self, cluster: str) -> list[Node]:
        rec = self._record(cluster)
        user, public = str((rec or {}).get("user") or "cloudtrain"), bool(
            (rec or {}).get("public_ip", True))
        try:
            api, project = self._cluster_api(cluster)
            live, _ = self._scan(api, project, cluster)
        except AuthError as exc:
            # Nothing recorded and nothing configured: this machine cannot have created it
            # (and up asks before its project is known; ensure_network records it).
            if rec is None and code_of(exc) in ("credentials", "no-project"):
                return []
            raise
        return [self._node(i, user, public) for i in live]

    def master_port(self, cluster: str) -> int:
        if self.amap is not None and self.amap.setting("master_port"):
            return int(self.amap.setting("master_port"))
        return 29500

    def node_env(self, cluster: str) -> dict[str, str]:
        if self.amap is not None and self.amap.setting("python"):
            return {"CLOUDTRAIN_PYTHON": str(self.amap.setting("python"))}
        return {}

    # --- contract: terminate ---------------------------------------------------------------

    def terminate(self, cluster: str) -> None:
        api, project = self._cluster_api(cluster)
        TD.teardown(api, project, cluster, self._owner(cluster), sleep=self.sleep, poll=self.poll)

    # --- gc ------------------------------------------------------------------------------

    def _gc_projects(self) -> list[tuple[str, str | None]]:
        """(project, credentials file) pairs to search: the default project, and those of
        this machine's GCP clusters."""
        found: dict[str, str | None] = {}
        try:
            found[self._api(None).clients.project(None)] = None
        except AuthError:
            pass
        clusters = self.ctx.home / "clusters"
        if clusters.is_dir():
            for f in sorted(clusters.glob(f"*/{RECORD}")):
                try:
                    rec = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if rec.get("project") and rec["project"] not in found:
                    found[rec["project"]] = rec.get("credentials_file")
        if not found:
            self._api(None).clients.project(None)   # raises the AuthError with the fix
        return list(found.items())

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[TD.Resource]:
        """Resources marked by cloudtrain (this owner's, or anyone's with ``any_owner``) that
        no live cluster owns. ``live``: the names of this machine's GCP clusters. GCE's
        aggregated lists cover every zone, so ``all_regions`` changes nothing."""
        owner = None if any_owner else self.owner
        out: list[TD.Resource] = []
        for project, cred in self._gc_projects():
            for r in TD.find(self._api(cred), project, None, owner).resources:
                if r.cluster in live and r.owner == L.owner_value(self._owner(r.cluster)):
                    continue
                r.project, r.credentials_file = project, cred
                out.append(r)
        return out

    def remove(self, resources: list[TD.Resource]) -> None:
        """Remove what :meth:`orphans` found, cluster by cluster (instances first)."""
        groups: dict[tuple[str, str | None, str, str], None] = {}
        for r in resources:
            groups[(r.project, r.credentials_file, r.cluster, r.owner)] = None
        problems = []
        for project, cred, cluster, owner in groups:
            api = self._api(cred)
            try:
                TD.teardown(api, project or api.clients.project(None), cluster, owner or None,
                            sleep=self.sleep, poll=self.poll)
            except AuthError:
                raise
            except ProviderError as exc:
                problems.append(f"{cluster}: {exc.message}")
        if problems:
            raise ProviderError("GCP cleanup did not finish: " + " | ".join(problems),
                                "Run 'cloudtrain gc' again.")
