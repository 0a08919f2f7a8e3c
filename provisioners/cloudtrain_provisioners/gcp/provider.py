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
failed multi-node attempt got is deleted before the next zone is tried. The loop over regions
and zones is :class:`~cloudtrain.provider.cloud.CloudProvider`'s; what is GCE's own is here.

What it remembers locally is only a hint (``$CLOUDTRAIN_HOME/clusters/<name>/gcp.json``:
the project, written before anything is created, and the zone, attempts and login). The
truth is the labels: ``down`` and ``gc`` work without the hint (in the default project).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from cloudtrain.provider import fabric
from cloudtrain.errors import AuthError, UserError, code_of
from cloudtrain.provider import (ClusterRequest, NetworkRef, Node, NodeHealth, Plan,
                                 ProviderCheck, SelfStop, Target)
from cloudtrain.provider.cloud import Existing
from cloudtrain.provider.failover import Pin, Unavailable, worst

from . import (access, compact, gpunics, health, identity, images, instances, network, selfstop,
               stopstart, tags, teardown)
from .api import Api, GoogleClients
from .options import REGION_RE, ZONE_RE, GCPOptions
from .placement import GCPPlacement

RECORD = "gcp.json"


class GCPProvider(GCPPlacement):
    name: ClassVar[str] = "gcp"
    sdk_modules: ClassVar[tuple[str, ...]] = ("google.auth", "google.api_core",
                                              "google.cloud.compute_v1")
    title: ClassVar[str] = "GCP"
    options_model: ClassVar[type[GCPOptions]] = GCPOptions
    shape_examples = ("T4:1, A100:8", "a2-highgpu-8g")
    zone_re = ZONE_RE
    zone_example = ("us-central1-a", "-a")
    region_re = REGION_RE
    region_example = "us-central1"
    regions_hint = ("Drop resources.gcp.regions/zones, or list regions the catalog prices it "
                    "in.")
    exhausted_hint = ("Try later, another region (resources.region, resources.gcp.regions) or "
                      "machine type, or the other market (use_spot); for quotas, ask for more "
                      "under IAM & Admin > Quotas in the GCP console.")

    def _setup(self, clients: GoogleClients | None) -> None:
        """``clients``: the compute clients (default: per credentials file, ADC)."""
        self._clients = clients
        self._factories: dict[str, GoogleClients] = {}
        self._apis: dict[int, Api] = {}
        self._images: dict[tuple[str, str | None, str, str | None], images.Image] = {}

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
        return tags.owner_value(owner)

    def _request_api(self, request: ClusterRequest) -> tuple[Api, str]:
        opts = self._opts(request)
        api = self._api(opts.credentials_file)
        return api, api.clients.project(opts.project)

    def _cluster_api(self, cluster: str) -> tuple[Api, str]:
        """The API and project of an existing cluster: from its record, else the defaults."""
        rec = self._record(cluster)
        api = self._api(rec.get("credentials_file"))
        return api, api.clients.project(rec.get("project"))

    def _zones(self, api: Api, project: str, request: ClusterRequest, target: Target,
               pin: Pin | None) -> list[str]:
        if pin is not None and pin.zone:
            return [pin.zone]
        opts = self._opts(request)
        if opts.zones:
            return [z for z in opts.zones if z.startswith(target.region + "-")]
        if target.zones:
            return [z for z in target.zones if z.startswith(target.region + "-")]
        return images.region_zones(api, project, target.region)

    def check_access(self, timeout: float) -> ProviderCheck:
        """``cloudtrain check gcp`` (see :mod:`.access`)."""
        return access.check(self._factory(None), timeout)

    # --- contract: check and plan ----------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        opts = self._opts(request)
        self.check_place(request)
        region = self.region_of(request)
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
        self.check_shape(request)

    def plan(self, request: ClusterRequest) -> Plan:
        res, opts = request.resources, self._opts(request)
        targets = self.targets(request)
        for t in targets:   # a GPU the cloud does not know is refused before anything runs
            if t.accelerator:
                images.accelerator_type(t.accelerator)
        first = targets[0]
        owner = self._owner(request.name)
        base = tags.base_name(request.name, owner)
        project = opts.project or "the default project (GOOGLE_CLOUD_PROJECT or the credentials')"
        net = opts.network or network.dedicated_name(base)
        creates = ([] if opts.network else
                   [f"VPC network {net} (auto-mode, the cluster's own; deleted at teardown)"])
        creates += [f"firewall rule {r.name(base)} on network {net}: {r.text(base)}"
                    for r in network.desired_rules(base, self._cidr_text(request),
                                                   list(res.ports))]
        if fab := fabric.wanted(res.network, self.name, first.instance_type, request.num_nodes):
            creates += gpunics.plan_lines(base, fab, self._cidr_text(request))
            creates += [f"compact placement policy {compact.name(base)}"] if request.num_nodes > 1 else []
        market = ("spot (provisioningModel SPOT, termination action DELETE)" if res.use_spot
                  else "on-demand")
        gpus = (f" + {first.accelerator_count} x {images.accelerator_type(first.accelerator)} "
                "attached" if first.accelerator else "")
        image = images.describe_choice(res.image, opts.image_project, opts.image_family)
        disk = opts.disk_type or images.default_disk_type(first.instance_type)
        maint = ("TERMINATE" if first.accelerator or images.builtin_gpus(first.instance_type)
                 or res.use_spot else "MIGRATE")
        creates.append(
            f"{request.num_nodes} x {first.instance_type}{gpus} {market} instance(s) "
            f"{base}-0..{request.num_nodes - 1}, one zone: {image}; {res.disk_size_gb} GB "
            f"{disk} boot disk, deleted with the instance; onHostMaintenance {maint}; "
            f"network tag {base}; the cluster's SSH key in instance metadata (user "
            f"{opts.ssh_user})" + ("; no external IP" if not opts.public_ip else "")
            + selfstop.lifetime_text(request.max_hours))
        notes = [f"project: {project}",
                 f"every instance and boot disk is labelled {tags.CLUSTER}={request.name}, "
                 f"{tags.OWNER}={tags.owner_value(owner)}, {tags.RANK}; the firewall "
                 "rules carry the same marks in their description"]
        notes += [gpunics.plan_note(fab)] if fab else []
        made, said = identity.plan(request.buckets, identity.email_of(
            request.name, owner, opts.project or "PROJECT"), opts.service_account)
        return self.plan_of(request, targets, creates + made, notes + said)

    # --- contract: network ---------------------------------------------------------------

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        res, opts = request.resources, self._opts(request)
        self.begin_attempts(request.name)
        api, project = self._request_api(request)
        owner = self._owner(request.name)
        base = tags.base_name(request.name, owner)
        net_name = opts.network or network.dedicated_name(base)
        before = self._record(request.name).get("network")
        if not opts.network and before and not str(before).startswith("ct-"):
            # made by an earlier cloudtrain on a shared network: its nodes are not on ours
            raise UserError(f"GCP cluster '{request.name}' was created on network '{before}'; "
                            "cloudtrain now gives each cluster a network of its own.",
                            f"Take it down ('cloudtrain down {request.name}') and bring it up "
                            "again, or keep it where it is with resources.gcp.network: "
                            f"{before} (checked for rules wider than cloudtrain's).")
        # Written before anything is created: teardown looks in this project.
        self._save(request.name, project=project, network=net_name,
                   credentials_file=opts.credentials_file)
        cidr = self.cidr.get(res.ssh_cidr)
        if opts.network:
            network.check_network(api, project, opts.network)
            network.audit_network(api, project, opts.network, base, cidr, list(res.ports),
                                  opts.service_account)
        else:
            network.ensure_dedicated_network(api, project, base, request.name, owner)
        rules = network.desired_rules(base, cidr, list(res.ports))
        network.ensure_firewalls(api, project, net_name, base, request.name, owner, rules)
        self._save(request.name, ssh_cidr=cidr)
        return NetworkRef(f"{project}/{net_name}",
                          f"firewall rules on network {net_name} ({project}): "
                          + "; ".join(f"{r.name(base)}: {r.text(base)}" for r in rules))

    # --- contract: nodes -----------------------------------------------------------------

    def _scan(self, api: Api, project: str, cluster: str
              ) -> tuple[list[instances.Inst], list[instances.Inst]]:
        """(live: one per rank, the oldest when a rank somehow has two, in rank order;
        duplicates and instances without a rank)."""
        every = instances.describe(api, project, cluster, self._owner(cluster))
        by_rank: dict[int, instances.Inst] = {}
        dups = []
        for i in sorted(every, key=lambda i: (i.created_at, i.id)):
            if i.rank is not None and i.rank not in by_rank:
                by_rank[i.rank] = i
            else:
                dups.append(i)
        return [by_rank[r] for r in sorted(by_rank)], dups

    def find_existing(self, request: ClusterRequest) -> Existing:
        name = request.name
        api, project = self._request_api(request)
        live, dups = self._scan(api, project, name)
        self._save(name, num_nodes=request.num_nodes)
        self.check_ranks(request, [i.rank for i in live if i.rank is not None])
        if dups:
            self.ui.warn(f"gcp: deleting {len(dups)} duplicate instance(s) of '{name}': "
                         + ", ".join(i.name for i in dups))
            by_zone: dict[str, list[str]] = {}
            for i in dups:
                by_zone.setdefault(i.zone, []).append(i.name)
            instances.delete(api, project, by_zone)
        have = {int(i.rank): i for i in live if i.rank is not None}
        if not live:
            return Existing(have)
        first = live[0]
        return Existing(have, self._target(first.region, first.machine_type,
                                           request.resources.accelerators), first.zone)

    def _image(self, api: Api, project: str, request: ClusterRequest) -> images.Image:
        res, opts = request.resources, self._opts(request)
        key = (project, res.image, opts.image_project, opts.image_family)
        if key not in self._images:
            self._images[key] = images.find_image(api, res.image, opts.image_project,
                                               opts.image_family)
        return self._images[key]

    def launch_target(self, request: ClusterRequest, target: Target, pin: Pin | None,
                      have: dict[int, Any]) -> list[Node]:
        api, project = self._request_api(request)
        zones = self._zones(api, project, request, target, pin)
        if not zones:
            raise Unavailable(f"no zone of {target.region} to try")
        missing = [r for r in range(request.num_nodes) if r not in have]
        image = None
        if missing:
            image = self._image(api, project, request)
            images.check_disk(image, request.resources.disk_size_gb)
        accel = images.accelerator_type(target.accelerator) if target.accelerator else None

        def skip(zone: str) -> str | None:
            return images.offered_in_zone(api, project, zone, target.instance_type,
                                          accel) if missing else None

        return self.each_zone(
            request, target, zones,
            lambda zone: self._launch_zone(api, project, request, target, image, zone, missing,
                                           have),
            skip=skip, none_left=f"no zone of {target.region} offers {target.instance_type}"
                                 + (f" with {accel}" if accel else ""))

    def _launch_zone(self, api: Api, project: str, request: ClusterRequest, target: Target,
                     image: images.Image | None, zone: str, missing: list[int],
                     have: dict[int, instances.Inst]) -> list[Node]:
        res, opts = request.resources, self._opts(request)
        new: dict[int, str] = {}
        account = self._account(api, project, request)   # every up: bindings follow the task
        if missing:
            assert image is not None
            owner = self._owner(request.name)
            base = tags.base_name(request.name, owner)
            fab = fabric.wanted(res.network, self.name, target.instance_type, request.num_nodes)
            nics = gpunics.ensure(api, project, target.region, base, request.name, owner, fab,
                                  str(self._record(request.name).get("ssh_cidr"))) if fab else []
            self._save(request.name, fabric_env=gpunics.node_env(fab) if fab else {})
            place = compact.ensure(api, project, target.region, base, request.name, owner) \
                if fab and request.num_nodes > 1 else None
            spec = instances.LaunchSpec(
                project=project, zone=zone, base=base,
                machine_type=target.instance_type, accelerator=target.accelerator,
                accelerator_count=target.accelerator_count, image=image,
                disk_gb=res.disk_size_gb,
                disk_type=opts.disk_type or images.default_disk_type(target.instance_type),
                cluster=request.name, owner=owner, spot=res.use_spot,
                network=opts.network or network.dedicated_name(base),
                subnetwork=opts.subnetwork, public_ip=opts.public_ip,
                ssh_user=opts.ssh_user, public_key=request.public_key,
                service_account=account, install_driver=opts.install_nvidia_driver,
                max_run_seconds=selfstop.run_seconds(request.max_hours), gpu_nics=tuple(nics),
                placement_policy=place)
            new, errors = instances.launch(api, spec, missing)
            if errors:
                self._rollback(api, project, zone, list(new.values()))
                raise worst(list(errors.values()))
        stopped = [i.name for i in have.values() if i.status == "TERMINATED"]
        try:
            if stopped:
                instances.start(api, project, zone, stopped)
            names = [i.name for i in have.values()] + list(new.values())
            running = instances.wait_running(api, project, zone, names,
                                             need_public=opts.public_ip, sleep=self.sleep,
                                             poll=self.poll, timeout=self.running_timeout)
            self._save(request.name, region=target.region, zone=zone,
                       machine_type=target.instance_type, user=opts.ssh_user,
                       public_ip=opts.public_ip)
            keys = instances.wait_host_keys(api, project, zone, [i.name for i in running],
                                            opts.host_key_wait, self.sleep, self.ui.warn)
            self._save(request.name, host_keys={
                **(self._record(request.name).get("host_keys") or {}),
                **{k: list(v) for k, v in keys.items()}})
            return [self._node(i, opts.ssh_user, opts.public_ip, keys.get(i.name, ()))
                    for i in running]
        except BaseException:
            self._rollback(api, project, zone, list(new.values()))
            raise

    def _account(self, api: Api, project: str, request: ClusterRequest) -> str | None:
        """The nodes' service account: the user's own, or the cluster's (only for gs://)."""
        own, gs = self._opts(request).service_account, identity.gcs_buckets(request.buckets)
        if own or not gs:
            return own
        known = set(self._record(request.name).get("gcs_buckets") or [])
        self._save(request.name, gcs_buckets=sorted(known | {b.bucket for b in gs}))
        return identity.ensure(api, project, request.name, self._owner(request.name), gs)

    def _rollback(self, api: Api, project: str, zone: str, names: list[str]) -> None:
        """Delete the instances this attempt made (the ones it adopted are left alone)."""
        if names:
            self.ui.warn(f"gcp: deleting the {len(names)} node(s) this attempt got in {zone}: "
                         + ", ".join(names))
            instances.delete(api, project, {zone: names})

    def _node(self, i: instances.Inst, user: str, public: bool,
              host_keys: tuple[str, ...] = ()) -> Node:
        return self.node_at(rank=int(i.rank or 0),
                            instance_id=f"{i.name}/{i.id}" if i.id else i.name,
                            address=i.nat_ip if public else i.internal_ip,
                            private=i.internal_ip, user=user,
                            status=instances.STATUS.get(i.status, "unknown"), spot=i.spot,
                            host_keys=host_keys)

    def list_nodes(self, cluster: str) -> list[Node]:
        rec = self.records.read(cluster)
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

    # --- what GCE says of each node (ReportsNodeHealth; see :mod:`.health`) -----------------

    def node_health(self, cluster: str) -> list[NodeHealth]:
        n = self.records.note(cluster).num_nodes
        try:
            api, project = self._cluster_api(cluster)
        except AuthError as exc:
            return [NodeHealth(r, "", "unknown", exc.message) for r in range(n)]
        return health.node_health(api, project, cluster, self._owner(cluster), n)

    def discard_nodes(self, cluster: str, ranks: list[int]) -> None:
        api, project = self._cluster_api(cluster)
        gone = health.discard(api, project, cluster, self._owner(cluster), ranks)
        if gone:
            self.ui.info(f"gcp: deleted what was left of node(s) {sorted(ranks)}: "
                         + ", ".join(gone))

    # --- self-stop: the node guard's last act (SelfStops) -----------------------------------

    def stop_nodes(self, cluster: str) -> None:
        """``cloudtrain stop``; ``create_nodes`` starts them again (see :mod:`.stopstart`)."""
        api, project = self._cluster_api(cluster)
        live, dups = self._scan(api, project, cluster)
        stopstart.stop(api, project, live + dups)

    def stopped_still_bills(self, cluster: str) -> str:
        return stopstart.STILL_BILLS

    def self_stop_command(self, cluster: str, node: Node) -> str:
        """A guest power-off: GCE stops the VM (see :mod:`.selfstop`)."""
        return selfstop.COMMAND

    def what_still_bills(self) -> str:
        return selfstop.STILL_BILLS

    def self_stopped(self, cluster: str) -> list[SelfStop]:
        """The ranks whose instance is stopped (TERMINATED) after its guest powered off:
        when (lastStopTimestamp) and why (the guard's line on serial port 1)."""
        api, project = self._cluster_api(cluster)
        live, _ = self._scan(api, project, cluster)
        return [SelfStop(rank=int(i.rank or 0), instance_id=f"{i.name}/{i.id}" if i.id else i.name,
                         stopped_at=selfstop.stopped_at(i.last_stop),
                         reason=selfstop.serial_reason(api, project, i.zone, i.name))
                for i in live if i.status in selfstop.STOPPED]

    # --- contract: terminate ---------------------------------------------------------------

    def terminate(self, cluster: str) -> None:
        api, project = self._cluster_api(cluster)
        teardown.teardown(api, project, cluster, self._owner(cluster), sleep=self.sleep,
                          poll=self.poll)
        if "gcs_buckets" in self._record(cluster):   # only clusters that had one
            identity.teardown(api, project, cluster, tags.owner_value(self._owner(cluster)),
                              list(self._record(cluster)["gcs_buckets"]))

    # --- gc ------------------------------------------------------------------------------

    def _gc_projects(self) -> list[tuple[str, str | None]]:
        """(project, credentials file) pairs to search: the default project, and those of
        this machine's GCP clusters."""
        found: dict[str, str | None] = {}
        try:
            found[self._api(None).clients.project(None)] = None
        except AuthError:
            pass
        for rec in self.records.every():
            if rec.get("project") and rec["project"] not in found:
                found[rec["project"]] = rec.get("credentials_file")
        if not found:
            self._api(None).clients.project(None)   # raises the AuthError with the fix
        return list(found.items())

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[teardown.Resource]:
        """Resources marked by cloudtrain (this owner's, or anyone's with ``any_owner``) that
        no live cluster owns. ``live``: the names of this machine's GCP clusters. GCE's
        aggregated lists cover every zone, so ``all_regions`` changes nothing."""
        owner = None if any_owner else self.owner
        out: list[teardown.Resource] = []
        for project, cred in self._gc_projects():
            for r in teardown.find(self._api(cred), project, None, owner).resources:
                if r.cluster in live and r.owner == tags.owner_value(self._owner(r.cluster)):
                    continue
                r.project, r.credentials_file = project, cred
                out.append(r)
            out += self._orphan_accounts(project, cred, live, owner)
        return out

    def _orphan_accounts(self, project: str, cred: str | None, live: set[str],
                         owner: str | None) -> list[teardown.Resource]:
        """The nodes' service accounts of clusters no live one owns (see identity.py)."""
        try:
            found = identity.find(self._api(cred), project, None,
                                  tags.owner_value(owner) if owner else None)
        except AuthError as exc:
            self.ui.warn(f"gcp: could not list service accounts ({exc.message}); gc skipped them")
            return []
        return [teardown.Resource("global", "service-account", str(sa.get("email")),
                                  m[tags.CLUSTER], m.get(tags.OWNER, ""), "", project=project,
                                  credentials_file=cred)
                for sa in found for m in [identity.marks(sa)]
                if not (m[tags.CLUSTER] in live
                        and m.get(tags.OWNER) == tags.owner_value(self._owner(m[tags.CLUSTER])))]

    def remove(self, resources: list[teardown.Resource]) -> None:
        """Remove what :meth:`orphans` found, cluster by cluster (instances first)."""
        groups: dict[tuple[str, str | None, str, str], None] = {}
        for r in resources:
            groups[(r.project, r.credentials_file, r.cluster, r.owner)] = None

        def remove(group: tuple[str, str | None, str, str]) -> None:
            project, cred, cluster, owner = group
            api = self._api(cred)
            teardown.teardown(api, project or api.clients.project(None), cluster, owner or None,
                              sleep=self.sleep, poll=self.poll)
            if any(r.kind == "service-account" and r.cluster == cluster for r in resources):
                identity.teardown(api, project or api.clients.project(None), cluster,
                                  owner or None, [])

        self.remove_each(list(groups), remove, label=lambda group: f"{group[2]}: ",
                         failed="GCP cleanup did not finish: ", hint="Run 'cloudtrain gc' again.")
