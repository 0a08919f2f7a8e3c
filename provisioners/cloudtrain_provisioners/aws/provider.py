"""The AWS provider: the contract of :mod:`cloudtrain.provider` on EC2.

Where it launches: ``resources.region`` (and ``zone``). Through ``cloudtrain up`` a task
without a region gets one from the planner, which also fails over to the next region in price
order; called directly without a region, this provider walks the same order itself. Within a
region the zones that sell the type are tried in turn; a multi-node cluster stays in one zone.
Capacity errors move to the next zone, quota errors to the next region, credential errors stop
at once, throttling is retried with backoff; every attempt is kept and shown (``attempts``).
The loop over regions and zones is the base's; EFA is :mod:`.efa`'s.

What it remembers locally is only a hint (``$CLOUDTRAIN_HOME/clusters/<name>/aws.json``: the
regions it created something in, written before it creates anything there). The truth is the
tags; without the hint ``terminate`` searches every enabled region.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from cloudtrain.errors import AuthError, CapacityError, ProviderError, QuotaError, UserError
from cloudtrain.provider import (ClusterRequest, NetworkRef, Node, NodeHealth, Plan,
                                 ProviderCheck, SelfStop, Target, generate_host_key,
                                 host_key_cloud_config)
from cloudtrain.provider.cloud import Existing
from cloudtrain.provider.failover import Pin, Unavailable, worst

from . import (access, efa, health, identity, images, instances, network, selfstop, stopstart,
               tags, teardown)
from .api import Api, BotoClients, ClientFactory, IamApi
from .options import AWSOptions
from .placement import AWSPlacement

RECORD = "aws.json"
HOST_KEY_POLL = 5.0


class AWSProvider(AWSPlacement):
    name: ClassVar[str] = "aws"
    sdk_modules: ClassVar[tuple[str, ...]] = ("boto3", "botocore")
    title: ClassVar[str] = "AWS"
    options_model: ClassVar[type[AWSOptions]] = AWSOptions
    shape_examples = ("A100:8", "p4d.24xlarge")
    zone_re = re.compile(r"^([a-z]{2}(-[a-z]+)+-\d+)[a-z]$")
    zone_example = ("us-east-1b", "a")
    record_base: ClassVar[dict[str, Any]] = {"regions": []}
    exhausted_hint = ("Try later, another region (resources.region; leave it out and 'up' tries "
                      "the next one in price order) or instance type, or the other market "
                      "(use_spot); for quotas, ask AWS for more in the Service Quotas console.")

    def _setup(self, clients: ClientFactory | None) -> None:
        """``clients``: EC2 clients per region (default boto3's, standard credential chain)."""
        self.clients = clients if clients is not None else BotoClients(
            os.environ.get("CLOUDTRAIN_AWS_PROFILE") or None)
        self.api = Api(self.clients, sleep=self.sleep)
        self.iam = IamApi(self.clients, sleep=self.sleep)
        self._nets: dict[tuple[str, str], network.RegionNet] = {}

    def _remember_region(self, cluster: str, region: str) -> None:
        """Written before anything is created in ``region``: teardown looks there."""
        regions = self._record(cluster).get("regions", [])
        if region not in regions:
            self._save(cluster, regions=[*regions, region])

    def check_access(self, timeout: float) -> ProviderCheck:
        """``cloudtrain check aws`` (see :mod:`.access`)."""
        profile = self.clients.profile if isinstance(self.clients, BotoClients) else None
        return access.check(profile, timeout)

    # --- contract: check and plan ----------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        opts = self._opts(request)
        self.check_place(request)
        if opts.vpc_id and not opts.subnet_ids:
            raise UserError("resources.aws.vpc_id is given without subnet_ids.",
                            "List the subnets (one per zone to try) in resources.aws.subnet_ids.")
        if opts.efa and request.num_nodes < 2:
            self.ui.warn("resources.aws.efa on a single node gives no benefit.")
        self.check_shape(request)

    def plan(self, request: ClusterRequest) -> Plan:
        res, opts = request.resources, self._opts(request)
        targets = self.targets(request)
        first = targets[0]
        owner = self._owner(request.name)
        base = tags.base_name(request.name, owner)
        rules = network.desired_rules(self._cidr_text(request), list(res.ports))
        where = f"VPC {opts.vpc_id}" if opts.vpc_id else "the default VPC"
        market = "spot" if res.use_spot else "on-demand"
        image = res.image or "the newest AWS Deep Learning AMI (PyTorch, OSS NVIDIA driver, Ubuntu)"
        creates = [f"security group {base} in {where} of {first.region}: "
                   + "; ".join(r.text() for r in rules) + " (nothing else inbound)",
                   f"key pair {base} (the cluster's SSH public key)"]
        if request.num_nodes > 1 and opts.placement_group and _may_cluster_place(first.instance_type):
            creates.append(f"cluster placement group {base} (where {first.instance_type} "
                           "supports one)")
        creates.append(
            f"{request.num_nodes} x {first.instance_type} {market} instance(s), one zone: image "
            f"{image}; {res.disk_size_gb} GiB encrypted gp3 root volume; IMDSv2 required; "
            "shutdown terminates" + efa.plan_text(res.network, opts.efa, first.instance_type,
                                                  request.num_nodes))
        notes = [f"every resource is tagged {tags.CLUSTER}={request.name}, {tags.OWNER}={owner}, "
                 f"{tags.RANK}, {tags.CREATED}"]
        made, said = identity.plan(request.buckets, base, opts.iam_instance_profile)
        creates += made
        notes += said
        return self.plan_of(request, targets, creates, notes)

    # --- contract: network ---------------------------------------------------------------

    def _region_net(self, request: ClusterRequest, region: str) -> network.RegionNet:
        key = (request.name, region)
        if key in self._nets:
            return self._nets[key]
        opts = self._opts(request)
        cidr = self.cidr.get(request.resources.ssh_cidr)
        vpc = network.find_vpc(self.api, region, opts.vpc_id)
        subnets = network.subnets_by_zone(self.api, region, vpc, list(opts.subnet_ids))
        self._remember_region(request.name, region)
        owner = self._owner(request.name)
        base = tags.base_name(request.name, owner)
        gid = network.ensure_security_group(self.api, region, vpc, base, request.name, owner,
                                            network.desired_rules(cidr, list(request.resources.ports)))
        key_name = network.ensure_key_pair(self.api, region, base, request.public_key,
                                           request.name, owner)
        net = network.RegionNet(region, vpc, gid, key_name, subnets)
        self._nets[key] = net
        self._save(request.name, ssh_cidr=cidr)
        return net

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        self.begin_attempts(request.name)
        rules = "; ".join(r.text() for r in network.desired_rules(   # before anything is made
            self.cidr.get(request.resources.ssh_cidr), list(request.resources.ports)))
        live = self._scan(request.name)[0]
        regions = [live[0].region] if live else [t.region for t in self.targets(request)]
        for region in regions:
            try:
                net = self._region_net(request, region)
            except QuotaError as exc:
                self.record_attempt(request.name, region, None, "-", "quota", exc)
                continue
            return NetworkRef(f"{region}/{net.group_id}",
                              f"security group {net.group_id} in {net.vpc_id} ({region}): {rules}")
        raise self.exhausted(request, "no region had room for the cluster's network")

    # --- contract: nodes -------------------------------------------------------------------

    def _regions_to_search(self, cluster: str) -> list[str]:
        return list(self._record(cluster).get("regions") or [self._default_region()])

    def _scan(self, cluster: str) -> tuple[list[instances.Inst], list[instances.Inst],
                                           list[instances.Inst]]:
        """One look at the cluster's instances: (live: one per rank, the oldest when a rank
        somehow has two, in rank order; duplicates of a live rank or without a rank;
        ended: shutting down or terminated)."""
        owner, states = self._owner(cluster), [*instances.LIVE_STATES, "terminated"]
        regions = self._regions_to_search(cluster)
        def one(region: str) -> list[instances.Inst]:
            return instances.describe(self.api, region, cluster, owner, states)

        if len(regions) == 1:
            every = one(regions[0])
        else:
            with ThreadPoolExecutor(max_workers=min(8, len(regions))) as pool:
                every = [i for part in pool.map(one, regions) for i in part]
        ended = [i for i in every if i.state in ("shutting-down", "terminated")]
        by_rank: dict[int, instances.Inst] = {}
        dups = []
        for i in sorted(every, key=lambda i: (i.launch_time, i.instance_id)):
            if i.state in ("shutting-down", "terminated"):
                continue
            if i.rank is not None and i.rank not in by_rank:
                by_rank[i.rank] = i
            else:
                dups.append(i)
        return [by_rank[r] for r in sorted(by_rank)], dups, ended

    def find_existing(self, request: ClusterRequest) -> Existing:
        name = request.name
        live, dups, ended = self._scan(name)
        self._save(name, num_nodes=request.num_nodes)
        self.check_ranks(request, [i.rank for i in live if i.rank is not None])
        if dups:
            self.ui.warn(f"aws: terminating {len(dups)} duplicate instance(s) of '{name}': "
                         + ", ".join(i.instance_id for i in dups))
            for region in sorted({i.region for i in dups}):
                instances.terminate_ids(self.api, region,
                                        [i.instance_id for i in dups if i.region == region])
        for msg in _interrupted(ended, {i.rank for i in live}):
            self.ui.warn(msg + "; launching a replacement")
        have = {int(i.rank): i for i in live if i.rank is not None}
        if not live:
            return Existing(have)
        return Existing(have, Target(self.name, live[0].region, live[0].instance_type, None),
                        live[0].zone)

    def launch_target(self, request: ClusterRequest, target: Target, pin: Pin | None,
                      have: dict[int, Any]) -> list[Node]:
        res, opts, name = request.resources, self._opts(request), request.name
        region, itype = target.region, target.instance_type
        info = images.type_info(self.api, region, itype)
        if info is None:
            raise Unavailable(f"{itype} is not sold in {region}")
        lay = efa.chosen(res.network, opts.efa, info, request.num_nodes)   # before anything
        zones = images.offered_zones(self.api, region, itype)
        if pin is not None:
            zones = [z for z in zones if z == pin.zone]
        if not zones:
            raise Unavailable(f"{itype} is not offered in "
                              + (f"zone {pin.zone}" if pin else f"any zone of {region}"))
        missing = [r for r in range(request.num_nodes) if r not in have]
        image = None
        if missing:
            try:
                image = images.find_image(self.api, region, res.image, info.arch)
            except images.ImageNotFound as exc:
                raise Unavailable(exc.message) from None
            images.check_disk(image, res.disk_size_gb)
        net = self._region_net(request, region)
        pg = None
        if missing and request.num_nodes > 1 and opts.placement_group and info.cluster_placement:
            owner = self._owner(name)
            pg = network.ensure_placement_group(self.api, region, tags.base_name(name, owner),
                                                name, owner)
        if opts.subnet_ids:   # the user's subnets: their zones, in the order given
            zones = [z for z in net.subnets if z in zones]
            if not zones:
                raise Unavailable(f"{itype} is not offered in the zones of subnet_ids")

        def launch(zone: str) -> list[Node]:
            nodes = self._launch_zone(request, info, image, net, zone, pg, missing, have)
            self._save(name, region=region, zone=zone, instance_type=itype, user=opts.ssh_user,
                       public_ip=opts.public_ip, fabric_env=efa.node_env(itype) if lay else {})
            return nodes

        return self.each_zone(
            request, target, zones, launch,
            skip=lambda zone: None if zone in net.subnets else "no subnet in this zone",
            none_left=f"no zone of {region} has a subnet for the cluster")

    def _launch_zone(self, request: ClusterRequest, info: images.TypeInfo,
                     image: images.Image | None, net: network.RegionNet, zone: str,
                     pg: str | None, missing: list[int],
                     have: dict[int, instances.Inst]) -> list[Node]:
        res, opts, region = request.resources, self._opts(request), net.region
        new: dict[int, str] = {}
        lay, owner = efa.chosen(res.network, opts.efa, info, request.num_nodes), self._owner(
            request.name)
        # A host key per new node, installed by cloud-init before sshd first starts, pinned.
        host = {r: generate_host_key() for r in missing} if opts.inject_host_key else {}
        profile = self._profile(request)   # on every up: the policy follows the task's buckets
        if missing:
            assert image is not None
            spec = instances.LaunchSpec(
                region=region, zone=zone, subnet_id=net.subnets[zone], group_id=net.group_id,
                key_name=net.key_name, instance_type=info.name, image=image,
                disk_gb=res.disk_size_gb, cluster=request.name, owner=owner,
                spot=res.use_spot, spot_max_price=opts.spot_max_price, placement_group=pg,
                efa=lay, public_ip=opts.public_ip,
                iam_instance_profile=profile,
                user_data={r: host_key_cloud_config(*k) for r, k in host.items()} or None)
            new, errors = instances.launch(self.api, spec, missing)
            if errors:
                first = worst(list(errors.values()))
                if not self._rollback(region, list(new.values())) and isinstance(
                        first, (CapacityError, QuotaError)):
                    raise _stuck(first)
                raise first
        stopped = [i.instance_id for i in have.values() if i.state in ("stopped", "stopping")]
        if stopped:
            instances.start_stopped(self.api, region, stopped)
        ids = [i.instance_id for i in have.values()] + list(new.values())
        try:
            running = instances.wait_running(
                self.api, region, ids, need_public=opts.public_ip, sleep=self.sleep, poll=self.poll,
                attach=efa.attacher(self.api, region, request.name, owner, lay, opts.public_ip))
            injected = {new[r]: (host[r][1],) for r in new if r in host}
            keys = self._host_keys(region, [i for i in new.values() if i not in injected],
                                   opts.host_key_wait)
            keys.update(injected)
            known = dict(self._record(request.name).get("host_keys") or {})
            known.update({i: list(k) for i, k in keys.items()})
            self._save(request.name, region=region, user=opts.ssh_user,
                       public_ip=opts.public_ip, host_keys=known)
            # a started (stopped) instance keeps its host key, pinned again at its new address
            return [self._node(i, tuple(keys.get(i.instance_id) or known.get(i.instance_id)
                                        or ()), opts.ssh_user, opts.public_ip)
                    for i in running]
        except (CapacityError, QuotaError) as exc:
            if not self._rollback(region, list(new.values())):
                raise _stuck(exc) from exc
            raise
        except BaseException:
            self._rollback(region, list(new.values()))
            raise

    def _profile(self, request: ClusterRequest) -> str | None:
        """The nodes' instance profile: the user's own, or the cluster's (created here, only
        when the task names S3 buckets)."""
        own = self._opts(request).iam_instance_profile
        buckets = identity.s3_buckets(request.buckets)
        if own or not buckets:
            return own
        self._save(request.name, identity=True)   # before creating: down looks for it
        return identity.ensure(self.iam, request.name, self._owner(request.name), buckets)

    def _rollback(self, region: str, ids: list[str]) -> bool:
        """Terminate the instances this launch made (the ones it adopted are left alone).
        A failure here is reported, not raised: the error that caused the rollback is the
        one to show, and ``down`` (or the core's rollback) finds the rest by tag. Returns
        whether every one of them is terminated (or terminating)."""
        if not ids:
            return True
        self.ui.warn(f"aws: terminating the {len(ids)} node(s) this attempt got in {region}: "
                     + ", ".join(ids))
        try:
            alive = [i.instance_id for i in instances.describe_ids(self.api, region, ids)
                     if i.state not in ("shutting-down", "terminated")]
            instances.terminate_ids(self.api, region, alive)
        except ProviderError as exc:
            self.ui.warn(f"aws: could not terminate them yet ({exc.message}); "
                         "'cloudtrain down' removes them by tag")
            return False
        return True

    def _host_keys(self, region: str, ids: list[str], wait: float) -> dict[str, tuple[str, ...]]:
        """Each new node's host keys from its console, all nodes polled together every few
        seconds until each has printed them or ``wait`` seconds have passed."""
        keys: dict[str, tuple[str, ...]] = {}
        if not ids or wait <= 0:
            return keys
        deadline = time.monotonic() + wait
        pending = list(ids)
        with ThreadPoolExecutor(max_workers=min(16, len(ids))) as pool:
            while True:
                found = pool.map(lambda i: (i, instances.console_host_keys(self.api, region, i)),
                                 pending)
                keys.update({i: k for i, k in found if k})
                pending = [i for i in pending if i not in keys]
                if not pending or time.monotonic() >= deadline:
                    return keys
                self.sleep(HOST_KEY_POLL)

    def interruptions(self, cluster: str) -> list[str]:
        """Nodes AWS took back (spot interruptions) that have no replacement yet, in words:
        what to tell the user instead of calling it a crash."""
        live, _, ended = self._scan(cluster)
        return _interrupted(ended, {i.rank for i in live})

    def _node(self, i: instances.Inst, host_keys: tuple[str, ...], user: str,
              public: bool) -> Node:
        return self.node_at(rank=int(i.rank or 0), instance_id=i.instance_id,
                            address=i.public_ip if public else i.private_ip,
                            private=i.private_ip, user=user,
                            status=instances.STATUS.get(i.state, "unknown"), spot=i.spot,
                            host_keys=host_keys)

    # --- what EC2 says of each node (ReportsNodeHealth) -------------------------------------

    def node_health(self, cluster: str) -> list[NodeHealth]:
        return health.node_health(self.api, self._regions_to_search(cluster), cluster,
                                  self._owner(cluster),
                                  self.records.note(cluster).num_nodes)

    def discard_nodes(self, cluster: str, ranks: list[int]) -> None:
        ids = health.discard(self.api, self._regions_to_search(cluster), cluster,
                             self._owner(cluster), ranks, sleep=self.sleep)
        if ids:
            self.ui.info(f"aws: terminated what was left of node(s) {sorted(ranks)}: "
                         + ", ".join(ids))

    def list_nodes(self, cluster: str) -> list[Node]:
        user, public = self._login(cluster, "ubuntu")
        keys = self._record(cluster).get("host_keys") or {}
        return [self._node(i, tuple(keys.get(i.instance_id) or ()), user, public)
                for i in self._scan(cluster)[0]]

    # --- stop / start (StopsNodes; create_nodes starts stopped instances) --------------------

    def stop_nodes(self, cluster: str) -> None:
        live, dups, _ = self._scan(cluster)
        stopstart.stop(self.api, live + dups, sleep=self.sleep, poll=self.poll)

    def stopped_still_bills(self, cluster: str) -> str:
        return stopstart.STILL_BILLS

    # --- self-stop: the node guard's last act (SelfStops) -----------------------------------

    def self_stop_command(self, cluster: str, node: Node) -> str:
        """A guest power-off: EC2 terminates the instance (see :mod:`.selfstop`)."""
        return selfstop.COMMAND

    def what_still_bills(self) -> str:
        return selfstop.STILL_BILLS

    def self_stopped(self, cluster: str) -> list[SelfStop]:
        """The ranks whose latest instance EC2 terminated on a guest shutdown, with no live
        replacement: when (EC2's transition time) and why (the guard's console line)."""
        live, _, ended = self._scan(cluster)
        seen = {i.rank for i in live}
        out = []
        for i in sorted(ended, key=lambda i: (i.launch_time, i.instance_id), reverse=True):
            if i.rank is None or i.rank in seen or i.reason != selfstop.GUEST_SHUTDOWN:
                continue
            seen.add(i.rank)
            out.append(SelfStop(rank=i.rank, instance_id=i.instance_id,
                                stopped_at=selfstop.stopped_at(i.transition) or time.time(),
                                reason=selfstop.console_reason(self.api, i.region,
                                                               i.instance_id)))
        return sorted(out, key=lambda s: s.rank)

    # --- contract: terminate ---------------------------------------------------------------

    def enabled_regions(self) -> list[str]:
        found = self.api.call(self._default_region(), "describe_regions").get("Regions", [])
        return sorted(r["RegionName"] for r in found
                      if r.get("OptInStatus", "opt-in-not-required") != "not-opted-in")

    def _teardown(self, work: list[tuple[str, str, str | None]]) -> None:
        """Tear down (region, cluster, owner) triples in parallel; one error naming all."""
        self.remove_each(work, lambda item: teardown.teardown_region(
            self.api, item[0], item[1], item[2], sleep=self.sleep),
            label=lambda item: f"{item[0]}: ", failed="AWS teardown did not finish: ",
            hint="Run 'cloudtrain down' again; nothing was forgotten locally.", workers=8)

    def terminate(self, cluster: str) -> None:
        regions = list(self._record(cluster).get("regions") or self.enabled_regions())
        self._teardown([(r, cluster, self._owner(cluster)) for r in regions])
        rec = self._record(cluster)
        if rec.get("identity") or not rec:
            try:
                identity.teardown_cluster(self.iam, cluster, self._owner(cluster))
            except AuthError as exc:
                if rec.get("identity"):
                    raise
                self.ui.warn(f"aws: could not look for the cluster's IAM role ({exc.message})")
        self._nets = {k: v for k, v in self._nets.items() if k[0] != cluster}

    # --- gc ------------------------------------------------------------------------------

    def gc_regions(self, all_regions: bool) -> list[str]:
        if all_regions:
            return self.enabled_regions()
        regions = {self._default_region()}
        for rec in self.records.every():
            regions.update(rec.get("regions", []))
        return sorted(regions)

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[teardown.Resource]:
        """Resources tagged by cloudtrain (this owner's, or anyone's with ``any_owner``) that
        no live cluster owns. ``live``: the names of this machine's AWS clusters."""
        regions = self.gc_regions(all_regions)
        owner = None if any_owner else self.owner

        def one(region: str) -> list[teardown.Resource]:
            return teardown.find(self.api, region, None, owner).resources

        with ThreadPoolExecutor(max_workers=min(8, len(regions))) as pool:
            found = [r for part in pool.map(one, regions) for r in part]
        try:
            found += identity.resources(identity.find(self.iam, None, owner))
        except AuthError as exc:
            self.ui.warn(f"aws: could not list IAM roles ({exc.message}); gc skipped them")
        return [r for r in found if not (r.cluster in live and r.owner == self._owner(r.cluster))]

    def remove(self, resources: list[teardown.Resource]) -> None:
        """Remove what :meth:`orphans` found, cluster by cluster (instances first)."""
        roles = [r for r in resources if r.region == identity.WHERE]
        groups = teardown.group_by_cluster([r for r in resources if r not in roles])
        self._teardown([(region, cluster, owner or None) for (region, cluster, owner) in groups])
        identity.remove(self.iam, identity.found_of(roles))


def _may_cluster_place(instance_type: str) -> bool:
    """For the plan (no API call): burstable and Mac types have no cluster placement groups.
    ``up`` asks EC2 (DescribeInstanceTypes) instead of guessing."""
    return not instance_type.startswith(("t2.", "t3.", "t3a.", "t4g.", "mac"))


def _interrupted(ended: list[instances.Inst], live_ranks: set[int | None]) -> list[str]:
    out, seen = [], set(live_ranks)
    for i in sorted(ended, key=lambda i: (i.rank is None, i.rank or 0)):
        if i.interrupted and i.rank not in seen:
            out.append(f"node {i.rank} ({i.instance_id}, spot) was interrupted by AWS ({i.reason})")
            seen.add(i.rank)
    return out


def _stuck(exc: ProviderError) -> ProviderError:
    """A failover that must not happen: the nodes of the failed attempt are still there, and
    moving on (or giving up) would leave them running."""
    return ProviderError(f"{exc.message} The node(s) this attempt got could not be terminated, "
                         "so cloudtrain stops here.",
                         "Run 'cloudtrain down' (it finds them by tag), then up again.")
