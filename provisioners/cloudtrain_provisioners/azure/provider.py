"""The Azure provider: the contract of :mod:`cloudtrain.provider` on Azure Resource Manager.

Where it launches: ``resources.region`` (and ``zone``) when given; otherwise the regions the
catalog prices the size in, cheapest first (``resources.azure.regions`` narrows and orders
them). Within a region the zones where the subscription may use the size are tried in turn
(the Resource SKUs API says which); a multi-node cluster always stays in one zone. Capacity
errors (AllocationFailed, ZonalAllocationFailed, SkuNotAvailable, OverconstrainedAllocation
Request) move to the next zone, then the next region; quota errors (QuotaExceeded, and
OperationNotAllowed about a quota) to the next region at once; credential errors stop;
throttling is retried with backoff. Every attempt and its reason is kept (``attempts``, the
cluster's ``azure.json``) and shown.

Everything of a cluster is in one resource group of its own (``cloudtrain-<name>-<hash>``)
tagged like each resource in it; ``down`` deletes the group and checks that each resource is
gone. What is remembered locally (``$CLOUDTRAIN_HOME/clusters/<name>/azure.json``: the
subscription, group and region, written before anything is created) is only a hint: without
it the cluster is found by its tags in the default subscription.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from pydantic import BaseModel

from cloudtrain.provider import failover
from cloudtrain.provider.caller import CallerCidr, lookup_public_ip
from cloudtrain.provider.record import ClusterRecord
from cloudtrain.errors import AuthError, CapacityError, ProviderError, QuotaError, UserError
from cloudtrain.ownership import owner_of_cluster
from cloudtrain.provider import ClusterRequest, NetworkRef, Node, Plan, ProviderContext
from cloudtrain.keys import generate_host_key, host_key_cloud_config

from . import network as NET
from . import tags as T
from . import teardown as TD
from . import vms as V
from .api import Api, AzureClients, code_of
from .options import ZONES, AzureOptions

if TYPE_CHECKING:
    from cloudtrain.provider.addrmap import AddressMap
    from cloudtrain.catalog.model import Offer
    from cloudtrain.ui import UI

RECORD = "azure.json"
_FROM_ENV: Any = object()
MAX_PARALLEL = 16


@dataclass(frozen=True)
class Target:
    """One region to try, with the size it would use there and its price per node-hour."""

    region: str
    size: str
    price: float | None


class _Unavailable(Exception):
    """This region cannot run the request at all (size not sold or not allowed, no image)."""


class AzureProvider:
    name: ClassVar[str] = "azure"
    options_model: ClassVar[type[BaseModel] | None] = AzureOptions
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = False

    def __init__(self, ctx: ProviderContext, *, clients: AzureClients | None = None,
                 caller_ip: Callable[[], str] | None = None,
                 offers: Callable[[], list[Offer]] | None = None,
                 sleep: Callable[[float], None] = time.sleep, owner: str | None = None,
                 ui: UI | None = None, address_map: Any = _FROM_ENV, poll: float = 5.0,
                 running_timeout: float = 900.0) -> None:
        self.ctx = ctx
        self.records = ClusterRecord(ctx, self.name)
        self.clients = clients if clients is not None else AzureClients()
        self.sleep = sleep
        self.poll = poll
        self.running_timeout = running_timeout
        self.owner = owner or T.default_owner(ctx.home)   # user@host/home-<this home's id>
        self.cidr = CallerCidr(ctx.home, caller_ip or lookup_public_ip)
        self._offers_fn = offers
        self._ui = ui
        if address_map is _FROM_ENV:
            from cloudtrain.provider import addrmap

            address_map = addrmap.AddressMap.from_env("azure")
        self.amap: AddressMap | None = address_map
        self._apis: dict[str, Api] = {}
        self._nets: dict[tuple[str, str], NET.RegionNet] = {}
        self._sizes: dict[tuple[str, str, str], V.SizeInfo | None] = {}
        self._attempts: dict[str, list[dict[str, Any]]] = {}

    # --- small helpers -----------------------------------------------------------------------

    @property
    def ui(self) -> UI:
        if self._ui is None:
            from cloudtrain.ui import UI

            self._ui = UI()
        return self._ui

    @staticmethod
    def _opts(request: ClusterRequest) -> AzureOptions:
        return request.options if isinstance(request.options, AzureOptions) else AzureOptions()

    def _owner(self, cluster: str | None) -> str:
        """The owner mark of ``cluster``'s resources: this home's, or plain user@host for a
        cluster this home created before owner marks carried a home id."""
        return owner_of_cluster(self.records.read(cluster) if cluster else None, self.owner)

    def _record_file(self, cluster: str) -> Path:
        return self.records.path(cluster)

    def _record(self, cluster: str) -> dict[str, Any]:
        return self.records.read(cluster) or {}

    def _save(self, cluster: str, **updates: Any) -> None:
        self.records.update(cluster, **updates)

    def _subscription(self, cluster: str, request: ClusterRequest | None = None) -> str:
        sub = (self._opts(request).subscription_id if request is not None else None) \
            or self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        if not sub:
            raise UserError("No Azure subscription is known for this cluster.",
                            "Set resources.azure.subscription_id in the task, or "
                            "AZURE_SUBSCRIPTION_ID, or choose a default one with "
                            "'az account set --subscription ID'.")
        return str(sub)

    def _api(self, subscription: str) -> Api:
        api = self._apis.get(subscription)
        if api is None:
            api = self._apis[subscription] = Api(self.clients.get(subscription), sleep=self.sleep)
        return api

    def group(self, cluster: str) -> str:
        """The name of the cluster's resource group."""
        return T.group_name(cluster, self._owner(cluster))

    def _offers(self) -> list[Offer]:
        if self._offers_fn is not None:
            return list(self._offers_fn())
        from cloudtrain.catalog.load import provider_offers

        return provider_offers(self.ctx.home, self.name)

    # --- where to launch ----------------------------------------------------------------------

    def targets(self, request: ClusterRequest) -> list[Target]:
        """The regions to try, in order, each with its size and price. Creates nothing and
        calls nothing (the catalog is local)."""
        from cloudtrain import planner

        res, opts = request.resources, self._opts(request)
        if res.accelerators is None and not res.instance_type:
            raise UserError("The Azure provider needs resources.accelerators (e.g. A100:8) or "
                            "resources.instance_type (e.g. Standard_ND96asr_v4).",
                            "Add one of them to the task's resources.")
        wanted = [res.region] if res.region else list(opts.regions)
        result = planner.rank(res.model_copy(update={"provider": "azure", "zone": None}),
                              request.num_nodes, self._offers(), spot=res.use_spot,
                              max_hourly_cost=res.max_hourly_cost)
        best: dict[str, Target] = {}
        for r in result.ranked:
            o = r.offer
            if o.region not in best and (not wanted or o.region in wanted):
                best[o.region] = Target(o.region, o.instance_type, r.per_node)
        if wanted:
            out = [best[w] for w in wanted if w in best]
            if res.instance_type:   # sizes the catalog does not price still run
                out = [best.get(w) or Target(w, res.instance_type, None) for w in wanted]
        else:
            out = list(best.values())
        if not out:
            if res.instance_type and res.accelerators is None and not wanted:
                raise UserError(f"The catalog prices {res.instance_type} in no region.",
                                "Give resources.region (or resources.azure.regions).")
            raise result.error() if not result.ranked else UserError(
                f"No offer for {result.want} in {', '.join(wanted)}.",
                "Drop resources.azure.regions, or list regions the catalog prices it in.")
        return out

    # --- contract: check and plan --------------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        res = request.resources
        if res.zone and res.zone not in ZONES:
            raise UserError(f"resources.zone '{res.zone}' is not an Azure availability zone.",
                            "Write 1, 2 or 3 (or leave it out to try every zone).")
        if res.zone and not res.region:
            raise UserError("resources.zone is given without resources.region.",
                            "Azure zones are numbered per region: give the region too.")
        if res.image:
            V.parse_image(res.image)
        if request.num_nodes > 1000:
            raise UserError("The Azure provider creates at most 1000 nodes per cluster.",
                            "Use fewer nodes.")
        self.targets(request)

    def plan(self, request: ClusterRequest) -> Plan:
        res, opts = request.resources, self._opts(request)
        targets = self.targets(request)
        first = targets[0]
        group = self.group(request.name)
        cidr = res.ssh_cidr or self.cidr.cached() or "your public IP/32 (looked up when up runs)"
        rules = NET.desired_rules(cidr, list(res.ports), opts.vnet_cidr)
        market = "spot (priority Spot, eviction policy Delete)" if res.use_spot else "on-demand"
        image = res.image or (f"{V.image_text(V.HPC_IMAGE)} (Ubuntu 22.04 HPC: NVIDIA driver, "
                              "CUDA, NCCL; plain Ubuntu 22.04 on sizes without generation 2)")
        creates = [
            f"resource group {group} in {first.region} (everything below is in it)",
            f"virtual network {T.VNET} {opts.vnet_cidr}, subnet {T.SUBNET} "
            f"{NET.subnet_cidr(opts.vnet_cidr)}",
            f"network security group {T.NSG} on the subnet, inbound: "
            + "; ".join(r.text() for r in rules),
        ]
        if opts.public_ip:
            creates.append(f"{request.num_nodes} x Standard static public IPv4 address")
        creates.append(f"{request.num_nodes} x network interface (accelerated networking where "
                       f"{first.size} supports it)")
        creates.append(f"{request.num_nodes} x {first.size} VM, {market}, one zone: image {image}; "
                       f"{res.disk_size_gb} GiB OS disk; user {opts.ssh_user}, SSH key only "
                       "(passwords disabled)")
        notes = [f"every resource is tagged {T.CLUSTER}={request.name}, {T.OWNER}={self._owner(request.name)}, "
                 f"{T.RANK}, {T.CREATED}"]
        zone_note = f"zone {res.zone}" if res.zone else f"the zones of {first.region} in turn"
        more = ", ".join(f"{t.region} ({t.size}"
                         + (f", ${t.price:.2f}/h per node)" if t.price is not None else ")")
                         for t in targets[1:4])
        notes.append(f"placement: {zone_note}" + (f"; then {more}" + (", ..." if len(targets) > 4
                                                                      else "") if more else ""))
        if first.price is None:
            notes.append(f"the catalog has no {'spot' if res.use_spot else 'on-demand'} price "
                         f"for {first.size} in {first.region}")
        accel = str(res.accelerators) if res.accelerators else None
        return Plan(provider="azure", num_nodes=request.num_nodes, region=first.region,
                    zone=res.zone, instance_type=first.size, accelerators=accel,
                    use_spot=res.use_spot, hourly_price_per_node=first.price, creates=creates,
                    notes=notes)

    # --- attempts ------------------------------------------------------------------------------

    def _attempt(self, cluster: str, region: str, zone: str | None, size: str, outcome: str,
                 err: BaseException | str) -> None:
        code = err if isinstance(err, str) else code_of(err)
        msg = err if isinstance(err, str) else getattr(err, "message", str(err))
        a = {"region": region, "zone": zone, "size": size, "outcome": outcome, "code": code,
             "message": msg, "at": T.now()}
        self._attempts.setdefault(cluster, []).append(a)
        if outcome != "ok":
            where = f"{region} zone {zone}" if zone else region
            self.ui.warn(f"azure {where} ({size}): {outcome}: {code}"
                         + (f" - {msg}" if msg and msg != code else ""))

    def attempts(self, cluster: str) -> list[dict[str, Any]]:
        """Every placement attempt of the last ``up`` and its outcome, in order."""
        if cluster in self._attempts:
            return list(self._attempts[cluster])
        return list(self._record(cluster).get("attempts", []))

    # --- contract: network ---------------------------------------------------------------------

    def _region_net(self, request: ClusterRequest, api: Api, region: str) -> NET.RegionNet:
        key = (request.name, region)
        if key in self._nets:
            return self._nets[key]
        opts, name = self._opts(request), request.name
        cidr = self.cidr.get(request.resources.ssh_cidr)
        owner = self._owner(name)
        group = T.group_name(name, owner)
        self._save(name, subscription_id=api.subscription_id, resource_group=group,
                   region=region, owner=owner, user=opts.ssh_user,
                   public_ip=opts.public_ip)
        shared = T.tags(name, owner, T.SHARED_RANK)
        try:
            NET.ensure_group(api, group, region, shared)
        except NET.GroupElsewhere as exc:
            # A former attempt's group in another region, without live nodes (they pin the
            # region): remove it, then start again here.
            if any(v.status not in ("terminated",) for v in V.list_vms(api, group)):
                raise ProviderError(f"Azure cluster '{name}' has nodes in {exc.location}; the "
                                    f"task asks for {region}.",
                                    f"Take it down first ('cloudtrain down {name}') or use "
                                    "another name.") from None
            self.ui.warn(f"azure: removing {group} from {exc.location} (a former attempt) to "
                         f"start again in {region}")
            TD.teardown(api, name, owner, expected=group, sleep=self.sleep, poll=self.poll)
            self._nets = {k: v for k, v in self._nets.items() if k[0] != name}
            NET.ensure_group(api, group, region, shared)
        net = NET.ensure_network(api, group, region, NET.desired_rules(
            cidr, list(request.resources.ports), opts.vnet_cidr), opts.vnet_cidr, shared)
        self._nets[key] = net
        self._save(name, ssh_cidr=cidr)
        return net

    def _existing_region(self, api: Api, cluster: str) -> str | None:
        g = NET.get_group(api, self.group(cluster))
        if g is None:
            return None
        if not any(v.status != "terminated" for v in V.list_vms(api, self.group(cluster))):
            return None
        return str(g.get("location"))

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        name = request.name
        api = self._api(self._subscription(name, request))
        region = self._existing_region(api, name) or self.targets(request)[0].region
        net = self._region_net(request, api, region)
        rules = "; ".join(r.text() for r in NET.desired_rules(
            self.cidr.get(request.resources.ssh_cidr), list(request.resources.ports),
            self._opts(request).vnet_cidr))
        return NetworkRef(net.subnet_id, f"NSG {T.NSG} in {net.group} ({region}): {rules}")

    # --- contract: nodes -----------------------------------------------------------------------

    def _size(self, api: Api, region: str, size: str) -> V.SizeInfo | None:
        key = (api.subscription_id, region, size.lower())
        if key not in self._sizes:
            self._sizes[key] = V.size_info(api, region, size)
        return self._sizes[key]

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        name, n, res = request.name, request.num_nodes, request.resources
        api = self._api(self._subscription(name, request))
        self._attempts[name] = []
        group = self.group(name)
        vms = V.list_vms(api, group)
        broken = [v for v in vms if v.state == "Failed"]
        if broken:
            self.ui.warn(f"azure: deleting {len(broken)} VM(s) of '{name}' that failed to "
                         "provision: " + ", ".join(v.name for v in broken))
            self._delete_vms(api, group, [v.name for v in broken])
        live = [v for v in vms if v.state not in ("Failed", "Deleting") and v.rank is not None]
        too_many = sorted(v.rank for v in live if v.rank is not None and v.rank >= n)
        if too_many:
            raise UserError(f"Azure cluster '{name}' has node(s) of rank up to {too_many[-1]}; "
                            f"the task asks for {n} node(s).",
                            f"Take it down first ('cloudtrain down {name}') or use another name.")
        have = {v.rank: v for v in live if v.rank is not None}
        if have:   # the nodes that exist pin the region, size and zone (or no zone)
            first = min(have.values(), key=lambda v: v.rank or 0)
            targets = [Target(first.location, first.size, None)]
            pinned: tuple[str | None] | None = (first.zone,)
        else:
            targets = self.targets(request)
            pinned = (res.zone,) if res.zone else None
        for target in targets:
            if any(a["region"] == target.region and a["outcome"] in ("quota", "unavailable")
                   for a in self._attempts[name]):
                continue
            try:
                nodes = self._try_region(request, api, target, pinned, have)
            except _Unavailable as exc:
                self._attempt(name, target.region, None, target.size, "unavailable", str(exc))
                continue
            except QuotaError as exc:
                self._attempt(name, target.region, getattr(exc, "zone", None), target.size,
                              "quota", exc)
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
        lines = "; ".join(f"{a['region']}" + (f" zone {a['zone']}" if a["zone"] else "")
                          + f": {a['code']}" for a in tried) or "no region to try"
        cls: type[ProviderError] = QuotaError if tried and all(
            a["outcome"] in ("quota", "unavailable") for a in tried) else CapacityError
        return cls(f"Azure could not place {what} after {len(tried)} attempt(s): {lines}.",
                   "Try later, another region (resources.region, resources.azure.regions) or "
                   "size, or the other market (use_spot); for quotas, ask for more in the Azure "
                   "portal (Subscriptions > Usage + quotas).")

    def _try_region(self, request: ClusterRequest, api: Api, target: Target,
                    pinned: tuple[str | None] | None, have: dict[int, V.Vm]) -> list[Node]:
        """Make the missing nodes in ``target``'s region, trying its zones in turn (only
        ``pinned``'s zone when given: the task's, or the one the existing nodes are in)."""
        res, opts, name = request.resources, self._opts(request), request.name
        region, size = target.region, target.size
        info = self._size(api, region, size)
        if info is None:
            raise _Unavailable(f"{size} is not sold in {region}")
        if info.restricted:
            raise _Unavailable(f"{size} is not available to this subscription in {region}")
        if res.use_spot and not info.spot:
            raise _Unavailable(f"{size} cannot run as spot in {region}")
        zones: list[str | None]
        if pinned is not None:
            zone = pinned[0]
            if zone is not None and zone not in info.zones:
                raise _Unavailable(f"{size} is not offered in zone {zone} of {region}")
            zones = [zone]
        elif opts.zones:
            zones = [z for z in opts.zones if z in info.zones] if info.zones else [None]
            if not zones:
                raise _Unavailable(f"{size} is not offered in zones {', '.join(opts.zones)} of "
                                   f"{region}")
        else:
            zones = list(info.zones) or [None]
        missing = [r for r in range(request.num_nodes) if r not in have]
        image = V.choose_image(res.image, info.generations)
        if missing and not V.image_available(api, region, image):
            raise _Unavailable(f"image {V.image_text(image)} is not offered in {region}")
        net = self._region_net(request, api, region)
        nics = self._node_nics(request, api, net, info, missing)
        spec = V.VmSpec(region=region, group=net.group, size=size, image=image,
                        disk_gb=res.disk_size_gb, premium_disk=info.premium_io,
                        user=opts.ssh_user, public_key=request.public_key, cluster=name,
                        owner=self._owner(name), spot=res.use_spot, spot_max_price=opts.spot_max_price)
        last: ProviderError | None = None
        for zone in zones:
            try:
                nodes = self._launch_zone(request, api, spec, zone, nics, have)
            except CapacityError as exc:
                self._attempt(name, region, zone, size, "capacity", exc)
                last = exc
                continue
            except QuotaError as exc:
                exc.zone = zone  # type: ignore[attr-defined]
                raise
            except ProviderError as exc:
                self._attempt(name, region, zone, size, failover.outcome_of(exc), exc)
                raise
            self._attempt(name, region, zone, size, "ok", "launched")
            self._save(name, region=region, zone=zone, size=size, user=opts.ssh_user,
                       public_ip=opts.public_ip)
            return nodes
        assert last is not None
        raise last

    def _node_nics(self, request: ClusterRequest, api: Api, net: NET.RegionNet,
                   info: V.SizeInfo, ranks: list[int]) -> dict[int, str]:
        """A public IP (when asked for) and a NIC for each rank in ``ranks``: NIC id by rank."""
        opts, name = self._opts(request), request.name
        accel = opts.accelerated_networking and info.accelerated_networking
        created = T.now()

        def one(rank: int) -> tuple[int, str]:
            tg = T.tags(name, self._owner(name), rank, created)
            pip = V.ensure_public_ip(api, net.group, net.region, T.ip_name(name, rank), tg) \
                if opts.public_ip else None
            return rank, V.ensure_nic(api, net.group, net.region, T.nic_name(name, rank),
                                      net.subnet_id, pip, accel, tg)

        if not ranks:
            return {}
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(ranks))) as pool:
            return dict(pool.map(one, ranks))

    def _launch_zone(self, request: ClusterRequest, api: Api, spec: V.VmSpec, zone: str | None,
                     nics: dict[int, str], have: dict[int, V.Vm]) -> list[Node]:
        name, group = request.name, spec.group
        where = f"{spec.region} zone {zone}" if zone else spec.region
        tried: list[str] = []
        created = T.now()
        # Each new VM gets a host key made here, installed by cloud-init from customData
        # before sshd starts, and pinned before the first connection. Azure never returns
        # customData through its API; on the VM only root reads it (waagent's ovf-env.xml).
        host = {r: generate_host_key() for r in nics}

        def one(rank: int) -> None:
            vm = T.vm_name(name, rank)
            api.lro(f"create VM {vm} ({spec.size}) in {where}",
                    api.c.compute.virtual_machines.begin_create_or_update, group, vm,
                    V.vm_body(spec, rank, nics[rank], zone, created,
                              custom_data=host_key_cloud_config(*host[rank])))

        try:
            if nics:
                errors: dict[int, ProviderError] = {}
                tried = [T.vm_name(name, r) for r in nics]
                with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(nics))) as pool:
                    futures = {r: pool.submit(one, r) for r in nics}
                    for r, fut in futures.items():
                        try:
                            fut.result()
                        except ProviderError as exc:
                            errors[r] = exc
                if errors:
                    raise failover.worst(list(errors.values()))
            vms = self._wait_running(api, group, request.num_nodes)
            for v in vms:
                if v.name in tried and v.disk_name:
                    self._tag_disk(api, group, v)
            if self.amap is not None:
                addrs = V.addresses(api, group)
                found = [addrs.get(v.nic_id.lower()) or V.Addresses("", "") for v in vms]
                self.amap.wait_for([x for a in found for x in (a.public, a.private) if x])
            # the public halves, by VM id, so every later listing reports the same keys
            made = {v.id.lower(): host[v.rank][1] for v in vms if v.rank in host}
            if made:
                self._save(name, host_keys={**(self._record(name).get("host_keys") or {}),
                                            **made})
            return self._nodes(api, name, group, vms)
        except BaseException:
            self._rollback(api, group, tried)
            raise

    def _tag_disk(self, api: Api, group: str, vm: V.Vm) -> None:
        tg = T.tags(vm.cluster, vm.owner, vm.rank if vm.rank is not None else "", vm.created_at)
        api.lro(f"tag OS disk {vm.disk_name}", api.c.compute.disks.begin_update, group,
                vm.disk_name, {"tags": tg})

    def _wait_running(self, api: Api, group: str, n: int) -> list[V.Vm]:
        deadline = time.monotonic() + self.running_timeout
        while True:
            vms = [v for v in V.list_vms(api, group) if v.rank is not None and v.rank < n]
            failed = [v for v in vms if v.state == "Failed" or v.status == "terminated"]
            if failed:
                raise ProviderError(f"VM {failed[0].name} is {failed[0].state or failed[0].power} "
                                    "instead of running.", "Run 'cloudtrain up' again, or 'down'.")
            stopped = [v for v in vms if v.status == "stopped"]
            for v in stopped:
                api.lro(f"start VM {v.name}", api.c.compute.virtual_machines.begin_start, group,
                        v.name)
            ready = [v for v in vms if v.status == "running"]
            if len(ready) == n and len({v.rank for v in ready}) == n:
                return sorted(ready, key=lambda v: v.rank or 0)
            if time.monotonic() >= deadline:
                raise ProviderError(f"{n - len(ready)} VM(s) of {group} did not start within "
                                    f"{self.running_timeout:.0f}s.",
                                    "Run 'cloudtrain up' again (it adopts what runs) or 'down'.")
            self.sleep(self.poll)

    def _delete_vms(self, api: Api, group: str, names: list[str]) -> None:
        def one(vm: str) -> None:
            try:
                api.lro(f"delete VM {vm}", api.c.compute.virtual_machines.begin_delete, group, vm)
            except ProviderError as exc:
                if code_of(exc) not in ("ResourceNotFound", "NotFound", "ResourceGroupNotFound"):
                    raise

        if names:
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(names))) as pool:
                list(pool.map(one, names))

    def _rollback(self, api: Api, group: str, names: list[str]) -> None:
        """Delete the VMs this attempt asked for (their NICs and IPs stay for the next zone;
        what was adopted is left alone)."""
        if not names:
            return
        exist = {v.name for v in V.list_vms(api, group)}
        gone = [n for n in names if n in exist]
        if gone:
            self.ui.warn(f"azure: deleting the {len(gone)} VM(s) this attempt got in {group}: "
                         + ", ".join(gone))
            self._delete_vms(api, group, gone)

    # --- nodes as cloudtrain sees them -----------------------------------------------------------

    def _nodes(self, api: Api, cluster: str, group: str, vms: list[V.Vm]) -> list[Node]:
        rec = self._record(cluster)
        user = str(rec.get("user") or "azureuser")
        public = bool(rec.get("public_ip", True))
        keys = rec.get("host_keys") or {}
        addrs = V.addresses(api, group) if vms else {}
        out = []
        for v in sorted(vms, key=lambda v: v.rank if v.rank is not None else 1 << 30):
            a = addrs.get(v.nic_id.lower(), V.Addresses("", ""))
            n = self._node(v, a, user, public)
            key = keys.get(v.id.lower())
            out.append(replace(n, host_keys=(str(key),)) if key else n)
        return out

    def _node(self, v: V.Vm, a: V.Addresses, user: str, public: bool) -> Node:
        addr = a.public if public else a.private
        rank = v.rank if v.rank is not None else 0
        status = v.status
        if self.amap is None:
            return Node(rank=rank, instance_id=v.id, host=addr, port=22, user=user,
                        internal_ip=a.private, status=status,  # type: ignore[arg-type]
                        root_dir="cloudtrain", spot=v.spot)
        # Test mode: only addresses the map gives are ever used.
        if not addr:
            return Node(rank=rank, instance_id=v.id, host="", user=user,
                        status=status, spot=v.spot)  # type: ignore[arg-type]
        what = f"node {rank} ({v.name})"
        t = self.amap.resolve(addr, what)
        inner = self.amap.resolve(a.private, what).host if a.private else t.host
        return Node(rank=rank, instance_id=v.id, host=t.host, port=t.port,
                    user=str(self.amap.setting("user") or user), internal_ip=inner,
                    status=status,  # type: ignore[arg-type]
                    root_dir=t.root_dir or "cloudtrain", spot=v.spot)

    def list_nodes(self, cluster: str) -> list[Node]:
        sub = self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        if not sub:
            return []    # nothing of it can be found (nor created yet: the record comes first)
        api = self._api(str(sub))
        group = self.group(cluster)
        vms = [v for v in V.list_vms(api, group) if v.rank is not None and v.owner == self._owner(cluster)]
        return self._nodes(api, cluster, group, vms)

    def master_port(self, cluster: str) -> int:
        if self.amap is not None and self.amap.setting("master_port"):
            return int(self.amap.setting("master_port"))
        return 29500

    def node_env(self, cluster: str) -> dict[str, str]:
        if self.amap is not None and self.amap.setting("python"):
            return {"CLOUDTRAIN_PYTHON": str(self.amap.setting("python"))}
        return {}

    # --- contract: terminate ---------------------------------------------------------------------

    def terminate(self, cluster: str) -> None:
        api = self._api(self._subscription(cluster))
        TD.teardown(api, cluster, self._owner(cluster), expected=self.group(cluster), sleep=self.sleep,
                    poll=self.poll)
        self._nets = {k: v for k, v in self._nets.items() if k[0] != cluster}

    # --- gc ----------------------------------------------------------------------------------------

    def gc_subscriptions(self) -> list[str]:
        subs = set()
        default = self.clients.default_subscription()
        if default:
            subs.add(default)
        clusters = self.ctx.home / "clusters"
        if clusters.is_dir():
            for f in clusters.glob(f"*/{RECORD}"):
                try:
                    sub = json.loads(f.read_text()).get("subscription_id")
                except (OSError, ValueError):
                    continue
                if sub:
                    subs.add(str(sub))
        if not subs:
            raise UserError("No Azure subscription to search.",
                            "Set AZURE_SUBSCRIPTION_ID, or 'az account set --subscription ID'.")
        return sorted(subs)

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[TD.Resource]:
        """Resource groups tagged by cloudtrain (this owner's, or anyone's with
        ``any_owner``) that no live cluster owns, each followed by what it holds. ``live``:
        the names of this machine's Azure clusters. Resource groups span every region, so
        ``all_regions`` changes nothing."""
        out: list[TD.Resource] = []
        owner = None if any_owner else self.owner
        for sub in self.gc_subscriptions():
            api = self._api(sub)
            for g in TD.find_groups(api, None, owner):
                tg = g.get("tags") or {}
                if tg.get(T.CLUSTER) in live and tg.get(T.OWNER) == self._owner(tg.get(T.CLUSTER, "")):
                    continue
                found = TD.as_resources(g, TD.inventory(api, str(g["name"])))
                if any(r.kind == "virtual-machine" for r in found):
                    # each VM's power state: gc terminates a running one only with --force
                    power = {v.name: v.status for v in V.list_vms(api, str(g["name"]))}
                    for r in found:
                        if r.kind == "virtual-machine" and r.name in power:
                            r.detail = f" [{power[r.name]}]"
                out += found
        return out

    def remove(self, resources: list[TD.Resource]) -> None:
        """Remove what :meth:`orphans` found: each listed resource group, whole."""
        problems = []
        for r in resources:
            if r.kind != "resource-group":
                continue
            api = self._api(r.subscription)
            try:
                TD.teardown(api, r.cluster, r.owner or None, expected=r.name, sleep=self.sleep,
                            poll=self.poll)
            except AuthError:
                raise
            except ProviderError as exc:
                problems.append(exc.message)
        if problems:
            raise ProviderError("Azure gc did not finish: " + " | ".join(problems),
                                "Run 'cloudtrain gc' again.")
