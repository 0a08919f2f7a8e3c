"""The Azure provider: the contract of :mod:`cloudtrain.provider` on Azure Resource Manager.

Where it launches: ``resources.region`` (and ``zone``) when given; otherwise the regions the
catalog prices the size in, cheapest first (``resources.azure.regions`` narrows and orders
them). Within a region the zones where the subscription may use the size are tried in turn
(the Resource SKUs API says which); a multi-node cluster always stays in one zone. Capacity
errors (AllocationFailed, ZonalAllocationFailed, SkuNotAvailable, OverconstrainedAllocation
Request) move to the next zone, then the next region; quota errors (QuotaExceeded, and
OperationNotAllowed about a quota) to the next region at once; credential errors stop;
throttling is retried with backoff. Every attempt and its reason is kept (``attempts``, the
cluster's ``azure.json``) and shown. The loop over regions and zones is
:class:`~cloudtrain.provider.cloud.CloudProvider`'s; what is Azure's own is here. Azure calls
an instance type a "size"; attempt records call it ``instance_type``, as on every cloud.

Everything of a cluster is in one resource group of its own (``cloudtrain-<name>-<hash>``)
tagged like each resource in it; ``down`` deletes the group and checks that each resource is
gone. What is remembered locally (``$CLOUDTRAIN_HOME/clusters/<name>/azure.json``: the
subscription, group and region, written before anything is created) is only a hint: without
it the cluster is found by its tags in the default subscription.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, ClassVar

from cloudtrain.provider import fabric
from cloudtrain.errors import NotAsked, ProviderError, UserError
from cloudtrain.provider import (ClusterRequest, NetworkRef, Node, NodeHealth, Plan, ProviderCheck,
                                 SelfStop,
                                 Target, generate_host_key, host_key_cloud_config)
from cloudtrain.provider.cloud import Existing
from cloudtrain.provider.failover import Pin, Unavailable, worst

from . import (access, health, ibfabric, identity, images, instances, network, selfstop,
               stopstart, tags, teardown)
from .api import Api, AzureClients
from .options import ZONES, AzureOptions
from .placement import AzurePlacement

RECORD = "azure.json"
MAX_PARALLEL = 16


class AzureProvider(AzurePlacement):
    name: ClassVar[str] = "azure"
    sdk_modules: ClassVar[tuple[str, ...]] = ("azure.identity", "azure.mgmt.compute",
                                              "azure.mgmt.network", "azure.mgmt.resource")
    title: ClassVar[str] = "Azure"
    options_model: ClassVar[type[AzureOptions]] = AzureOptions
    shape_examples = ("A100:8", "Standard_ND96asr_v4")
    default_poll = 5.0
    default_running_timeout = 900.0
    regions_hint = "Drop resources.azure.regions, or list regions the catalog prices it in."
    exhausted_hint = ("Try later, another region (resources.region, resources.azure.regions) "
                      "or size, or the other market (use_spot); for quotas, ask for more in the "
                      "Azure portal (Subscriptions > Usage + quotas).")

    def _setup(self, clients: AzureClients | None) -> None:
        """``clients``: ARM clients per subscription (default: DefaultAzureCredential's)."""
        self.clients = clients if clients is not None else AzureClients()
        self._apis: dict[str, Api] = {}
        self._nets: dict[tuple[str, str], network.RegionNet] = {}
        self._sizes: dict[tuple[str, str, str], images.SizeInfo | None] = {}

    def _subscription(self, cluster: str, request: ClusterRequest | None = None) -> str:
        sub = (self._opts(request).subscription_id if request is not None else None) \
            or self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        if not sub:
            raise NotAsked("No Azure subscription is known for this cluster.",
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
        return tags.group_name(cluster, self._owner(cluster))

    # --- attempts in words -------------------------------------------------------------------

    def where(self, region: str, zone: str | None) -> str:
        return f"{region} zone {zone}" if zone else region   # zones are numbered per region

    def check_access(self, timeout: float) -> ProviderCheck:
        """``cloudtrain check azure`` (see :mod:`.access`)."""
        return access.check(self.clients, timeout)

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
            images.parse_image(res.image)
        if request.num_nodes > 1000:
            raise UserError("The Azure provider creates at most 1000 nodes per cluster.",
                            "Use fewer nodes.")
        self.check_shape(request)

    def plan(self, request: ClusterRequest) -> Plan:
        res, opts = request.resources, self._opts(request)
        targets = self.targets(request)
        first = targets[0]
        group = self.group(request.name)
        rules = network.desired_rules(self._cidr_text(request), list(res.ports), opts.vnet_cidr)
        market = "spot (priority Spot, eviction policy Delete)" if res.use_spot else "on-demand"
        image = res.image or (f"{images.image_text(images.HPC_IMAGE)} (Ubuntu 22.04 HPC: NVIDIA "
                              "driver, CUDA, NCCL; plain Ubuntu 22.04 on sizes without "
                              "generation 2)")
        creates = [
            f"resource group {group} in {first.region} (everything below is in it)",
            f"virtual network {tags.VNET} {opts.vnet_cidr}, subnet {tags.SUBNET} "
            f"{network.subnet_cidr(opts.vnet_cidr)}",
            f"network security group {tags.NSG} on the subnet, inbound: "
            + "; ".join(r.text() for r in rules),
        ]
        if opts.public_ip:
            creates.append(f"{request.num_nodes} x Standard static public IPv4 address")
        creates.append(f"{request.num_nodes} x network interface (accelerated networking where "
                       f"{first.instance_type} supports it)")
        creates.append(f"{request.num_nodes} x {first.instance_type} VM, {market}, one zone: "
                       f"image {image}; {res.disk_size_gb} GiB OS disk; user {opts.ssh_user}, "
                       "SSH key only (passwords disabled)")
        if fab := fabric.wanted(res.network, self.name, first.instance_type, request.num_nodes):
            creates.append(ibfabric.plan_line(fab))
        if opts.self_stop:
            creates.append(selfstop.plan_line(group))
        notes = [f"every resource is tagged {tags.CLUSTER}={request.name}, "
                 f"{tags.OWNER}={self._owner(request.name)}, {tags.RANK}, {tags.CREATED}"]
        made, said = identity.plan(request.buckets, group)
        return self.plan_of(request, targets, creates + made, notes + said)

    # --- contract: network ---------------------------------------------------------------------

    def _region_net(self, request: ClusterRequest, api: Api, region: str) -> network.RegionNet:
        key = (request.name, region)
        if key in self._nets:
            return self._nets[key]
        opts, name = self._opts(request), request.name
        cidr = self.cidr.get(request.resources.ssh_cidr)
        owner = self._owner(name)
        group = tags.group_name(name, owner)
        self._save(name, subscription_id=api.subscription_id, resource_group=group,
                   region=region, owner=owner, user=opts.ssh_user,
                   public_ip=opts.public_ip)
        shared = tags.tags(name, owner, tags.SHARED_RANK)
        try:
            network.ensure_group(api, group, region, shared)
        except network.GroupElsewhere as exc:
            # A former attempt's group in another region, without live nodes (they pin the
            # region): remove it, then start again here.
            if any(v.status not in ("terminated",) for v in instances.list_vms(api, group)):
                raise ProviderError(f"Azure cluster '{name}' has nodes in {exc.location}; the "
                                    f"task asks for {region}.",
                                    f"Take it down first ('cloudtrain down {name}') or use "
                                    "another name.") from None
            self.ui.warn(f"azure: removing {group} from {exc.location} (a former attempt) to "
                         f"start again in {region}")
            teardown.teardown(api, name, owner, expected=group, sleep=self.sleep, poll=self.poll)
            self._nets = {k: v for k, v in self._nets.items() if k[0] != name}
            network.ensure_group(api, group, region, shared)
        net = network.ensure_network(api, group, region, network.desired_rules(
            cidr, list(request.resources.ports), opts.vnet_cidr), opts.vnet_cidr, shared)
        self._nets[key] = net
        self._save(name, ssh_cidr=cidr)
        return net

    def _existing_region(self, api: Api, cluster: str) -> str | None:
        g = network.get_group(api, self.group(cluster))
        if g is None:
            return None
        if not any(v.status != "terminated" for v in instances.list_vms(api, self.group(cluster))):
            return None
        return str(g.get("location"))

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        name = request.name
        self.begin_attempts(name)
        cidr = self.cidr.get(request.resources.ssh_cidr)   # before anything is created
        api = self._api(self._subscription(name, request))
        if self._opts(request).self_stop and selfstop.can_assign(api) is False:
            raise selfstop.permission_error(api.subscription_id)   # before anything exists
        identity.scopes(api, identity.containers(request.buckets))   # unknown account: refused
        region = self._existing_region(api, name) or self.targets(request)[0].region
        net = self._region_net(request, api, region)
        rules = "; ".join(r.text() for r in network.desired_rules(
            cidr, list(request.resources.ports),
            self._opts(request).vnet_cidr))
        return NetworkRef(net.subnet_id, f"NSG {tags.NSG} in {net.group} ({region}): {rules}")

    # --- contract: nodes -----------------------------------------------------------------------

    def _size(self, api: Api, region: str, size: str) -> images.SizeInfo | None:
        key = (api.subscription_id, region, size.lower())
        if key not in self._sizes:
            self._sizes[key] = images.size_info(api, region, size)
        return self._sizes[key]

    def find_existing(self, request: ClusterRequest) -> Existing:
        name = request.name
        api = self._api(self._subscription(name, request))
        group = self.group(name)
        found = instances.list_vms(api, group)
        broken = [v for v in found if v.state == "Failed"]
        if broken:
            self.ui.warn(f"azure: deleting {len(broken)} VM(s) of '{name}' that failed to "
                         "provision: " + ", ".join(v.name for v in broken))
            instances.delete_vms(api, group, [v.name for v in broken])
        live = [v for v in found if v.state not in ("Failed", "Deleting") and v.rank is not None]
        self._save(name, num_nodes=request.num_nodes)
        self.check_ranks(request, [v.rank for v in live if v.rank is not None])
        have = {v.rank: v for v in live if v.rank is not None}
        if not have:   # the nodes that exist pin the region, size and zone (or no zone)
            return Existing(have)
        first = min(have.values(), key=lambda v: v.rank or 0)
        return Existing(have, Target(self.name, first.location, first.size, None), first.zone)

    def launch_target(self, request: ClusterRequest, target: Target, pin: Pin | None,
                      have: dict[int, Any]) -> list[Node]:
        """Make the missing nodes in ``target``'s region, trying its zones in turn (only
        ``pin``'s zone when given: the task's, or the one the existing nodes are in)."""
        res, opts, name = request.resources, self._opts(request), request.name
        region, size = target.region, target.instance_type
        api = self._api(self._subscription(name, request))
        info = self._size(api, region, size)
        if info is None:
            raise Unavailable(f"{size} is not sold in {region}")
        if info.restricted:
            raise Unavailable(f"{size} is not available to this subscription in {region}")
        if res.use_spot and not info.spot:
            raise Unavailable(f"{size} cannot run as spot in {region}")
        zones: list[str | None]
        if pin is not None:
            zone = pin.zone
            if zone is not None and zone not in info.zones:
                raise Unavailable(f"{size} is not offered in zone {zone} of {region}")
            zones = [zone]
        elif opts.zones:
            zones = [z for z in opts.zones if z in info.zones] if info.zones else [None]
            if not zones:
                raise Unavailable(f"{size} is not offered in zones {', '.join(opts.zones)} of "
                                   f"{region}")
        else:
            zones = list(info.zones) or [None]
        missing = [r for r in range(request.num_nodes) if r not in have]
        fab = fabric.wanted(res.network, self.name, size, request.num_nodes)
        zones = [None] if fab else zones   # an availability set has no zone
        image = images.choose_image(res.image, info.generations)
        if missing and not images.image_available(api, region, image):
            raise Unavailable(f"image {images.image_text(image)} is not offered in {region}")
        net = self._region_net(request, api, region)
        nics = self._node_nics(request, api, net, info, missing)
        spec = instances.VmSpec(region=region, group=net.group, size=size, image=image,
                        disk_gb=res.disk_size_gb, premium_disk=info.premium_io,
                        user=opts.ssh_user, public_key=request.public_key, cluster=name,
                        owner=self._owner(name), spot=res.use_spot, spot_max_price=opts.spot_max_price,
                        identity=opts.self_stop or bool(identity.containers(request.buckets)),
                        availability_set=ibfabric.ensure_set(api, net.group, region, name,
                                                             self._owner(name)) if fab else None)
        self._save(name, fabric_env=ibfabric.node_env(fab, size) if fab else {})

        def launch(zone: str | None) -> list[Node]:
            nodes = self._launch_zone(request, api, spec, zone, nics, have)
            self._save(name, region=region, zone=zone, size=size, user=opts.ssh_user,
                       public_ip=opts.public_ip, self_stop=opts.self_stop)
            return nodes

        return self.each_zone(request, target, zones, launch)

    def _node_nics(self, request: ClusterRequest, api: Api, net: network.RegionNet,
                   info: images.SizeInfo, ranks: list[int]) -> dict[int, str]:
        """A public IP (when asked for) and a NIC for each rank in ``ranks``: NIC id by rank."""
        opts, name = self._opts(request), request.name
        accel = opts.accelerated_networking and info.accelerated_networking
        created = tags.now()

        def one(rank: int) -> tuple[int, str]:
            tg = tags.tags(name, self._owner(name), rank, created)
            pip = instances.ensure_public_ip(api, net.group, net.region, tags.ip_name(name, rank), tg) \
                if opts.public_ip else None
            return rank, instances.ensure_nic(api, net.group, net.region, tags.nic_name(name, rank),
                                      net.subnet_id, pip, accel, tg)

        if not ranks:
            return {}
        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(ranks))) as pool:
            return dict(pool.map(one, ranks))

    def _launch_zone(self, request: ClusterRequest, api: Api, spec: instances.VmSpec, zone: str | None,
                     nics: dict[int, str], have: dict[int, instances.Vm]) -> list[Node]:
        name, group = request.name, spec.group
        where = f"{spec.region} zone {zone}" if zone else spec.region
        tried: list[str] = []
        created = tags.now()
        # Each new VM gets a host key made here, installed by cloud-init from customData
        # before sshd starts, and pinned before the first connection. Azure never returns
        # customData through its API; on the VM only root reads it (waagent's ovf-env.xml).
        host = {r: generate_host_key() for r in nics}

        def one(rank: int) -> None:
            vm = tags.vm_name(name, rank)
            api.lro(f"create VM {vm} ({spec.size}) in {where}",
                    api.c.compute.virtual_machines.begin_create_or_update, group, vm,
                    instances.vm_body(spec, rank, nics[rank], zone, created,
                              custom_data=host_key_cloud_config(*host[rank])))

        try:
            if nics:
                errors: dict[int, ProviderError] = {}
                tried = [tags.vm_name(name, r) for r in nics]
                with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(nics))) as pool:
                    futures = {r: pool.submit(one, r) for r in nics}
                    for r, fut in futures.items():
                        try:
                            fut.result()
                        except ProviderError as exc:
                            errors[r] = exc
                if errors:
                    raise worst(list(errors.values()))
            running = instances.wait_running(api, group, self.running_timeout, self.poll,
                                             self.sleep, request.num_nodes)
            if self._opts(request).self_stop:
                selfstop.grant(api, group, running, self.sleep)
            identity.ensure(api, running, request.buckets, name, self._owner(name),
                            lambda s: self._save(name, blob_scopes=s),
                            list(self._record(name).get("blob_scopes") or []), self.sleep)
            for v in running:
                if v.name in tried and v.disk_name:
                    self._tag_disk(api, group, v)
            # the public halves, by VM id, so every later listing reports the same keys
            made = {v.id.lower(): host[v.rank][1] for v in running if v.rank in host}
            if made:
                self._save(name, host_keys={**(self._record(name).get("host_keys") or {}),
                                            **made})
            return self._nodes(api, name, group, running)
        except BaseException:
            self._rollback(api, group, tried)
            raise

    def _tag_disk(self, api: Api, group: str, vm: instances.Vm) -> None:
        tg = tags.tags(vm.cluster, vm.owner, vm.rank if vm.rank is not None else "", vm.created_at)
        api.lro(f"tag OS disk {vm.disk_name}", api.c.compute.disks.begin_update, group,
                vm.disk_name, {"tags": tg})

    def _rollback(self, api: Api, group: str, names: list[str]) -> None:
        """Delete the VMs this attempt asked for (their NICs and IPs stay for the next zone;
        what was adopted is left alone)."""
        if not names:
            return
        exist = {v.name for v in instances.list_vms(api, group)}
        gone = [n for n in names if n in exist]
        if gone:
            self.ui.warn(f"azure: deleting the {len(gone)} VM(s) this attempt got in {group}: "
                         + ", ".join(gone))
            instances.delete_vms(api, group, gone)

    # --- nodes as cloudtrain sees them -----------------------------------------------------------

    def _nodes(self, api: Api, cluster: str, group: str, found: list[instances.Vm]) -> list[Node]:
        user, public = self._login(cluster, "azureuser")
        keys = self._record(cluster).get("host_keys") or {}
        addrs = instances.addresses(api, group) if found else {}
        out = []
        for v in sorted(found, key=lambda v: v.rank if v.rank is not None else 1 << 30):
            a = addrs.get(v.nic_id.lower(), instances.Addresses("", ""))
            n = self._node(v, a, user, public)
            key = keys.get(v.id.lower())
            out.append(replace(n, host_keys=(str(key),)) if key else n)
        return out

    def _node(self, v: instances.Vm, a: instances.Addresses, user: str, public: bool) -> Node:
        rank = v.rank if v.rank is not None else 0
        return self.node_at(rank=rank, instance_id=v.id, address=a.public if public else a.private,
                            private=a.private, user=user, status=v.status, spot=v.spot)

    def list_nodes(self, cluster: str) -> list[Node]:
        sub = self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        if not sub:
            return []    # nothing of it can be found (nor created yet: the record comes first)
        api = self._api(str(sub))
        group = self.group(cluster)
        owner = self._owner(cluster)
        found = [v for v in instances.list_vms(api, group) if v.rank is not None and v.owner == owner]
        return self._nodes(api, cluster, group, found)

    # --- what Azure says of each node (ReportsNodeHealth; see health.py) --------------------------

    def node_health(self, cluster: str) -> list[NodeHealth]:
        n = self.records.note(cluster).num_nodes
        sub = self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        if not sub:
            return [NodeHealth(r, "", "unknown", "no Azure subscription") for r in range(n)]
        return health.node_health(self._api(str(sub)), self.group(cluster), cluster,
                                  self._owner(cluster), n)

    def discard_nodes(self, cluster: str, ranks: list[int]) -> None:
        gone = health.discard(self._api(self._subscription(cluster)), self.group(cluster),
                              cluster, self._owner(cluster), ranks)
        if gone:
            self.ui.info(f"azure: deleted what was left of node(s) {sorted(ranks)}: "
                         + ", ".join(gone))

    # --- the node guard's self-stop (SelfStops; see selfstop.py) ----------------------------------

    def stop_nodes(self, cluster: str) -> None:
        """``cloudtrain stop``: deallocate the cluster's own VMs (see :mod:`.stopstart`)."""
        sub = self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        if not sub:
            return
        api, group, owner = self._api(str(sub)), self.group(cluster), self._owner(cluster)
        stopstart.stop(api, group, [v for v in instances.list_vms(api, group)
                                    if v.rank is not None and v.owner == owner])

    def stopped_still_bills(self, cluster: str) -> str:
        return stopstart.STILL_BILLS

    def self_stop_command(self, cluster: str, node: Node) -> str:
        arm = self.clients.endpoint    # the node trusts its own CAs (the CA bundle is local)
        if self._record(cluster).get("self_stop") is False:
            return selfstop.NO_IDENTITY     # resources.azure.self_stop: false
        return selfstop.command(node.instance_id, arm=arm)

    def what_still_bills(self) -> str:
        return selfstop.WHAT_STILL_BILLS

    def self_stopped(self, cluster: str) -> list[SelfStop]:
        sub = self._record(cluster).get("subscription_id") or self.clients.default_subscription()
        return selfstop.stopped(instances.list_vms(self._api(str(sub)), self.group(cluster)) if sub else [])

    # --- contract: terminate ---------------------------------------------------------------------

    def terminate(self, cluster: str) -> None:
        api = self._api(self._subscription(cluster))
        identity.revoke(api, list(self._record(cluster).get("blob_scopes") or []),
                        identity.mark(cluster, self._owner(cluster)))
        teardown.teardown(api, cluster, self._owner(cluster), expected=self.group(cluster), sleep=self.sleep,
                    poll=self.poll)
        self._nets = {k: v for k, v in self._nets.items() if k[0] != cluster}

    # --- gc ----------------------------------------------------------------------------------------

    def gc_subscriptions(self) -> list[str]:
        subs = set()
        default = self.clients.default_subscription()
        if default:
            subs.add(default)
        for rec in self.records.every():
            if rec.get("subscription_id"):
                subs.add(str(rec["subscription_id"]))
        if not subs:
            raise UserError("No Azure subscription to search.",
                            "Set AZURE_SUBSCRIPTION_ID, or 'az account set --subscription ID'.")
        return sorted(subs)

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[teardown.Resource]:
        """Resource groups tagged by cloudtrain (this owner's, or anyone's with
        ``any_owner``) that no live cluster owns, each followed by what it holds. ``live``:
        the names of this machine's Azure clusters. Resource groups span every region, so
        ``all_regions`` changes nothing."""
        out: list[teardown.Resource] = []
        owner = None if any_owner else self.owner
        for sub in self.gc_subscriptions():
            api = self._api(sub)
            for g in teardown.find_groups(api, None, owner):
                tg = g.get("tags") or {}
                cluster = tg.get(tags.CLUSTER, "")
                if cluster in live and tg.get(tags.OWNER) == self._owner(cluster):
                    continue
                found = teardown.as_resources(g, teardown.inventory(api, str(g["name"])))
                if any(r.kind == "virtual-machine" for r in found):
                    # each VM's power state: gc terminates a running one only with --force
                    power = {v.name: v.status for v in instances.list_vms(api, str(g["name"]))}
                    for r in found:
                        if r.kind == "virtual-machine" and r.name in power:
                            r.detail = f" [{power[r.name]}]"
                out += found
        return out

    def remove(self, resources: list[teardown.Resource]) -> None:
        """Remove what :meth:`orphans` found: each listed resource group, whole."""
        self.remove_each(
            [r for r in resources if r.kind == "resource-group"],
            lambda r: teardown.teardown(self._api(r.subscription), r.cluster, r.owner or None,
                                        expected=r.name, sleep=self.sleep, poll=self.poll),
            label=lambda r: "", failed="Azure gc did not finish: ", hint="Run 'cloudtrain gc' again.")
