"""The AWS provider: the contract of :mod:`cloudtrain.provider` on EC2.

Where it launches: ``resources.region`` (and ``zone``). Through ``cloudtrain up`` a task
without a region gets one from the planner, which also fails over to the next region in price
order; called directly without a region, this provider walks the same order itself. Within a
region the zones that sell the type are tried in turn; a multi-node cluster always stays in
one zone. Capacity errors move to the next zone, quota errors to the next region, credential
errors stop at once, throttling is retried with backoff; every attempt and its reason is kept
(``attempts(cluster)``, the cluster's ``aws.json``) and shown.

What it remembers locally is only a hint (``$CLOUDTRAIN_HOME/clusters/<name>/aws.json``: the
regions it created something in, written before it creates anything there). The truth is
the tags; without the hint ``terminate`` searches every enabled region.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
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
from cloudtrain.keys import generate_host_key, host_key_cloud_config
from cloudtrain.provider import ClusterRequest, NetworkRef, Node, Plan, ProviderContext

from . import images as IMG
from . import instances as I
from . import network as NET
from . import tags as T
from . import teardown as TD
from .api import Api, BotoClients, ClientFactory, code_of
from .options import AWSOptions

if TYPE_CHECKING:
    from cloudtrain.catalog.model import Offer
    from cloudtrain.ui import UI

RECORD = "aws.json"
HOST_KEY_POLL = 5.0
_ZONE_RE = re.compile(r"^([a-z]{2}(-[a-z]+)+-\d+)[a-z]$")


@dataclass(frozen=True)
class Target:
    """One region to try, with the instance type it would use there and its price."""

    region: str
    instance_type: str
    price: float | None


class _Unavailable(Exception):
    """This region cannot run the request at all (type not sold, no image): try the next."""


class AWSProvider:
    name: ClassVar[str] = "aws"
    options_model: ClassVar[type[BaseModel] | None] = AWSOptions
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = False

    def __init__(self, ctx: ProviderContext, *, clients: ClientFactory | None = None,
                 caller_ip: Callable[[], str] | None = None,
                 offers: Callable[[], list[Offer]] | None = None,
                 sleep: Callable[[float], None] = time.sleep, owner: str | None = None,
                 ui: UI | None = None, address_map: AddressMap | None = None,
                 poll: float = 3.0) -> None:
        """``cls(ctx)`` is all cloudtrain calls; the rest is for tests and embedders:
        ``clients`` (EC2 clients per region; default boto3's, standard credential chain),
        ``caller_ip`` (this machine's public IP lookup), ``offers`` (the catalog's AWS
        offers), ``sleep`` (every wait and backoff), ``owner`` (the owner tag),
        ``ui`` (where progress and failover messages go), ``address_map`` (default: from
        ``CLOUDTRAIN_AWS_ADDRESS_MAP``, tests only), ``poll`` (seconds between describes
        while instances start)."""
        self.ctx = ctx
        self.records = ClusterRecord(ctx, self.name)
        self.clients = clients if clients is not None else BotoClients(
            os.environ.get("CLOUDTRAIN_AWS_PROFILE") or None)
        self.api = Api(self.clients, sleep=sleep)
        self.sleep = sleep
        self.poll = poll
        self.owner = owner or T.default_owner(ctx.home)   # user@host/home-<this home's id>
        self.cidr = CallerCidr(ctx.home, caller_ip or lookup_public_ip)
        self._offers_fn = offers
        self._ui = ui
        self.amap = address_map if address_map is not None else AddressMap.from_env("aws")
        self._nets: dict[tuple[str, str], NET.RegionNet] = {}
        self._attempts: dict[str, list[dict[str, Any]]] = {}

    # --- small helpers ---------------------------------------------------------------------

    @property
    def ui(self) -> UI:
        if self._ui is None:
            from cloudtrain.ui import UI

            self._ui = UI()
        return self._ui

    @staticmethod
    def _opts(request: ClusterRequest) -> AWSOptions:
        return request.options if isinstance(request.options, AWSOptions) else AWSOptions()

    def _owner(self, cluster: str | None) -> str:
        """The owner mark of ``cluster``'s resources: this home's, or plain user@host for a
        cluster this home created before owner marks carried a home id."""
        return owner_of_cluster(self.records.read(cluster) if cluster else None, self.owner)

    def _record_file(self, cluster: str) -> Path:
        return self.records.path(cluster)

    def _record(self, cluster: str) -> dict[str, Any] | None:
        return self.records.read(cluster)

    def _save(self, cluster: str, **updates: Any) -> None:
        self.records.update(cluster, {"regions": []}, **updates)

    def _remember_region(self, cluster: str, region: str) -> None:
        """Written before anything is created in ``region``: teardown looks there."""
        rec = self._record(cluster) or {"regions": []}
        if region not in rec.get("regions", []):
            self._save(cluster, regions=[*rec.get("regions", []), region])

    def _default_region(self) -> str:
        return self.clients.default_region()

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
        m = _ZONE_RE.match(res.zone or "")
        return m.group(1) if m else None

    def targets(self, request: ClusterRequest) -> list[Target]:
        """The regions to try, in order, each with its instance type and price. Creates
        nothing and calls nothing (the catalog is local)."""
        from cloudtrain import planner

        res = request.resources
        if res.accelerators is None and not res.instance_type:
            raise UserError("The AWS provider needs resources.accelerators (e.g. A100:8) or "
                            "resources.instance_type (e.g. p4d.24xlarge).",
                            "Add one of them to the task's resources.")
        region = self._region_of(request)
        offers = self._offers()
        result = planner.rank(res.model_copy(update={"provider": "aws", "zone": None,
                                                     "region": region}),
                              request.num_nodes, offers, spot=res.use_spot,
                              max_hourly_cost=res.max_hourly_cost)
        best: dict[str, Target] = {}
        for r in result.ranked:
            if r.offer.region not in best:
                best[r.offer.region] = Target(r.offer.region, r.offer.instance_type, r.per_node)
        if best:
            return list(best.values())
        itype = (res.instance_type or "").lower()
        known = any(o.instance_type.lower() == itype and region in (None, o.region)
                    for o in offers)
        if itype and res.accelerators is None and not known:
            # a type the catalog does not list (there) still runs; its price is unknown
            return [Target(region or self._default_region(), str(res.instance_type), None)]
        raise result.error()

    # --- contract: check and plan ----------------------------------------------------------

    def check(self, request: ClusterRequest) -> None:
        res, opts = request.resources, self._opts(request)
        if res.zone:
            m = _ZONE_RE.match(res.zone)
            if not m:
                raise UserError(f"resources.zone '{res.zone}' is not an AWS zone name.",
                                "Write e.g. us-east-1b (or leave it out to try every zone).")
            if res.region and m.group(1) != res.region:
                raise UserError(f"resources.zone {res.zone} is not in region {res.region}.",
                                f"Use a zone of {res.region}, e.g. {res.region}a.")
        if opts.vpc_id and not opts.subnet_ids:
            raise UserError("resources.aws.vpc_id is given without subnet_ids.",
                            "List the subnets (one per zone to try) in resources.aws.subnet_ids.")
        if opts.efa and request.num_nodes < 2:
            self.ui.warn("resources.aws.efa on a single node gives no benefit.")
        self.targets(request)

    def plan(self, request: ClusterRequest) -> Plan:
        res, opts = request.resources, self._opts(request)
        targets = self.targets(request)
        first = targets[0]
        base = T.base_name(request.name, self._owner(request.name))
        cidr = res.ssh_cidr or self.cidr.cached() or "your public IP/32 (looked up when up runs)"
        rules = NET.desired_rules(cidr, list(res.ports))
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
            "shutdown terminates" + ("; an EFA interface each" if opts.efa else ""))
        notes = [f"every resource is tagged {T.CLUSTER}={request.name}, {T.OWNER}={self._owner(request.name)}, "
                 f"{T.RANK}, {T.CREATED}"]
        zone_note = f"zone {res.zone}" if res.zone else f"the zones of {first.region} in turn"
        more = ", ".join(f"{t.region} ({t.instance_type}"
                         + (f", ${t.price:.2f}/h per node)" if t.price is not None else ")")
                         for t in targets[1:4])
        notes.append(f"placement: {zone_note}" + (f"; then {more}" + (", ..." if len(targets) > 4
                                                                      else "") if more else ""))
        if first.price is None:
            notes.append(f"the catalog has no {market} price for {first.instance_type} in "
                         f"{first.region}")
        accel = str(res.accelerators) if res.accelerators else None
        return Plan(provider="aws", num_nodes=request.num_nodes, region=first.region,
                    zone=res.zone, instance_type=first.instance_type, accelerators=accel,
                    use_spot=res.use_spot, hourly_price_per_node=first.price, creates=creates,
                    notes=notes)

    # --- contract: network ---------------------------------------------------------------

    def _attempt(self, cluster: str, region: str, zone: str | None, itype: str, outcome: str,
                 err: BaseException | str) -> None:
        code = err if isinstance(err, str) else code_of(err)
        msg = err if isinstance(err, str) else getattr(err, "message", str(err))
        a = {"region": region, "zone": zone, "instance_type": itype, "outcome": outcome,
             "code": code, "message": msg, "at": T.now()}
        self._attempts.setdefault(cluster, []).append(a)
        if outcome != "ok":
            self.ui.warn(f"aws {zone or region} ({itype}): {outcome}: {code}"
                         + (f" - {msg}" if msg and msg != code else ""))

    def attempts(self, cluster: str) -> list[dict[str, Any]]:
        """Every placement attempt of the last ``up`` and its outcome, in order."""
        if cluster in self._attempts:
            return list(self._attempts[cluster])
        return list((self._record(cluster) or {}).get("attempts", []))

    def _region_net(self, request: ClusterRequest, region: str) -> NET.RegionNet:
        key = (request.name, region)
        if key in self._nets:
            return self._nets[key]
        opts = self._opts(request)
        cidr = self.cidr.get(request.resources.ssh_cidr)
        vpc = NET.find_vpc(self.api, region, opts.vpc_id)
        subnets = NET.subnets_by_zone(self.api, region, vpc, list(opts.subnet_ids))
        self._remember_region(request.name, region)
        owner = self._owner(request.name)
        base = T.base_name(request.name, owner)
        gid = NET.ensure_security_group(self.api, region, vpc, base, request.name, owner,
                                        NET.desired_rules(cidr, list(request.resources.ports)))
        key_name = NET.ensure_key_pair(self.api, region, base, request.public_key, request.name,
                                       owner)
        net = NET.RegionNet(region, vpc, gid, key_name, subnets)
        self._nets[key] = net
        self._save(request.name, ssh_cidr=cidr)
        return net

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        live = self._live(request.name)
        regions = [live[0].region] if live else [t.region for t in self.targets(request)]
        for region in regions:
            try:
                net = self._region_net(request, region)
            except QuotaError as exc:
                self._attempt(request.name, region, None, "-", "quota", exc)
                continue
            rules = "; ".join(r.text() for r in NET.desired_rules(
                self.cidr.get(request.resources.ssh_cidr), list(request.resources.ports)))
            return NetworkRef(f"{region}/{net.group_id}",
                              f"security group {net.group_id} in {net.vpc_id} ({region}): {rules}")
        raise self._exhausted(request, "no region had room for the cluster's network")

    # --- contract: nodes -------------------------------------------------------------------

    def _regions_to_search(self, cluster: str) -> list[str]:
        rec = self._record(cluster)
        if rec and rec.get("regions"):
            return list(rec["regions"])
        return [self._default_region()]

    def _describe_regions(self, regions: list[str], cluster: str | None,
                          states: list[str] | None = None) -> list[I.Inst]:
        if len(regions) == 1:
            return I.describe(self.api, regions[0], cluster, self._owner(cluster), states)
        with ThreadPoolExecutor(max_workers=min(8, len(regions))) as pool:
            parts = list(pool.map(lambda r: I.describe(self.api, r, cluster, self._owner(cluster), states),
                                  regions))
        return [i for p in parts for i in p]

    def _scan(self, cluster: str) -> tuple[list[I.Inst], list[I.Inst], list[I.Inst]]:
        """One look at the cluster's instances: (live: one per rank, the oldest when a rank
        somehow has two, in rank order; duplicates of a live rank or without a rank;
        ended: shutting down or terminated)."""
        every = self._describe_regions(self._regions_to_search(cluster), cluster,
                                       [*I.LIVE_STATES, "terminated"])
        ended = [i for i in every if i.state in ("shutting-down", "terminated")]
        by_rank: dict[int, I.Inst] = {}
        dups = []
        for i in sorted(every, key=lambda i: (i.launch_time, i.instance_id)):
            if i.state in ("shutting-down", "terminated"):
                continue
            if i.rank is not None and i.rank not in by_rank:
                by_rank[i.rank] = i
            else:
                dups.append(i)
        return [by_rank[r] for r in sorted(by_rank)], dups, ended

    def _live(self, cluster: str) -> list[I.Inst]:
        return self._scan(cluster)[0]

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        name, n = request.name, request.num_nodes
        self._attempts.setdefault(name, [])
        live, dups, ended = self._scan(name)
        too_many = [i for i in live if i.rank is not None and i.rank >= n]
        if too_many:
            raise UserError(f"AWS cluster '{name}' has node(s) of rank up to {too_many[-1].rank}; "
                            f"the task asks for {n} node(s).",
                            f"Take it down first ('cloudtrain down {name}') or use another name.")
        if dups:
            self.ui.warn(f"aws: terminating {len(dups)} duplicate instance(s) of '{name}': "
                         + ", ".join(i.instance_id for i in dups))
            for region in sorted({i.region for i in dups}):
                I.terminate_ids(self.api, region, [i.instance_id for i in dups if i.region == region])
        for msg in _interrupted(ended, {i.rank for i in live}):
            self.ui.warn(msg + "; launching a replacement")
        if live:
            first = live[0]
            targets = [Target(first.region, first.instance_type, None)]
            pinned_zone: str | None = first.zone
        else:
            targets = self.targets(request)
            pinned_zone = request.resources.zone
        have = {int(i.rank): i for i in live if i.rank is not None}
        for target in targets:
            if any(a["region"] == target.region and a["outcome"] in ("quota", "unavailable")
                   for a in self._attempts[name]):
                continue
            try:
                nodes = self._try_region(request, target, pinned_zone, have)
            except _Unavailable as exc:
                self._attempt(name, target.region, None, target.instance_type, "unavailable",
                              str(exc))
                continue
            except QuotaError as exc:
                self._attempt(name, target.region, getattr(exc, "zone", None),
                              target.instance_type, "quota", exc)
                continue
            except CapacityError:
                continue   # each zone's attempt is recorded already
            finally:
                self._save(name, attempts=self._attempts[name])
            return nodes
        raise self._exhausted(request, "")

    def _exhausted(self, request: ClusterRequest, why: str) -> ProviderError:
        tried = [a for a in self._attempts.get(request.name, []) if a["outcome"] != "ok"]
        market = "spot" if request.resources.use_spot else "on-demand"
        what = (f"{request.num_nodes} x {request.resources.instance_type or request.resources.accelerators}"
                f" ({market})")
        lines = "; ".join(f"{a['zone'] or a['region']}: {a['code']}" for a in tried) or why
        cls: type[ProviderError] = QuotaError if tried and all(
            a["outcome"] in ("quota", "unavailable") for a in tried) else CapacityError
        return cls(f"AWS could not place {what} after {len(tried)} attempt(s): {lines}.",
                   "Try later, another region (resources.region; leave it out and 'up' tries "
                   "the next one in price order) or instance type, or the other market "
                   "(use_spot); for quotas, ask AWS for more in the Service Quotas console.")

    def _try_region(self, request: ClusterRequest, target: Target, pinned_zone: str | None,
                    have: dict[int, I.Inst]) -> list[Node]:
        res, opts, name = request.resources, self._opts(request), request.name
        region, itype = target.region, target.instance_type
        info = IMG.type_info(self.api, region, itype)
        if info is None:
            raise _Unavailable(f"{itype} is not sold in {region}")
        if opts.efa and not info.efa:
            raise UserError(f"resources.aws.efa: {itype} does not support EFA.",
                            "Remove efa, or pick an instance type with EFA (p4d, p5, ...).")
        zones = IMG.offered_zones(self.api, region, itype)
        if pinned_zone:
            zones = [z for z in zones if z == pinned_zone]
        if not zones:
            raise _Unavailable(f"{itype} is not offered in "
                               + (f"zone {pinned_zone}" if pinned_zone else f"any zone of {region}"))
        missing = [r for r in range(request.num_nodes) if r not in have]
        image = None
        if missing:
            try:
                image = IMG.find_image(self.api, region, res.image, info.arch)
            except IMG.ImageNotFound as exc:
                raise _Unavailable(exc.message) from None
            IMG.check_disk(image, res.disk_size_gb)
        net = self._region_net(request, region)
        pg = None
        if missing and request.num_nodes > 1 and opts.placement_group and info.cluster_placement:
            pg = NET.ensure_placement_group(self.api, region, T.base_name(name, self._owner(name)),
                                            name, self._owner(name))
        if opts.subnet_ids:   # the user's subnets: their zones, in the order given
            zones = [z for z in net.subnets if z in zones]
            if not zones:
                raise _Unavailable(f"{itype} is not offered in the zones of subnet_ids")
        last: ProviderError | None = None
        for zone in zones:
            if zone not in net.subnets:
                self._attempt(name, region, zone, itype, "unavailable",
                              "no subnet in this zone")
                continue
            try:
                nodes = self._launch_zone(request, info, image, net, zone, pg, missing, have)
            except CapacityError as exc:
                self._attempt(name, region, zone, itype, "capacity", exc)
                last = exc
                continue
            except QuotaError as exc:
                exc.zone = zone  # type: ignore[attr-defined]
                raise
            except ProviderError as exc:
                self._attempt(name, region, zone, itype, failover.outcome_of(exc), exc)
                raise
            self._attempt(name, region, zone, itype, "ok", "launched")
            self._save(name, region=region, zone=zone, instance_type=itype,
                       user=opts.ssh_user, public_ip=opts.public_ip)
            return nodes
        if last is not None:
            raise last
        raise _Unavailable(f"no zone of {region} has a subnet for the cluster")

    def _launch_zone(self, request: ClusterRequest, info: IMG.TypeInfo, image: IMG.Image | None,
                     net: NET.RegionNet, zone: str, pg: str | None, missing: list[int],
                     have: dict[int, I.Inst]) -> list[Node]:
        res, opts, region = request.resources, self._opts(request), net.region
        new: dict[int, str] = {}
        # A host key per new node, installed by cloud-init from the user data before sshd
        # first starts, and pinned before the first connection.
        host = {r: generate_host_key() for r in missing} if opts.inject_host_key else {}
        if missing:
            assert image is not None
            spec = I.LaunchSpec(
                region=region, zone=zone, subnet_id=net.subnets[zone], group_id=net.group_id,
                key_name=net.key_name, instance_type=info.name, image=image,
                disk_gb=res.disk_size_gb, cluster=request.name, owner=self._owner(request.name),
                spot=res.use_spot, spot_max_price=opts.spot_max_price, placement_group=pg,
                efa=opts.efa, public_ip=opts.public_ip,
                iam_instance_profile=opts.iam_instance_profile,
                user_data={r: host_key_cloud_config(*k) for r, k in host.items()} or None)
            new, errors = I.launch(self.api, spec, missing)
            if errors:
                worst = failover.worst(list(errors.values()))
                if not self._rollback(region, list(new.values())) and isinstance(
                        worst, (CapacityError, QuotaError)):
                    raise _stuck(worst)
                raise worst
        stopped = [i.instance_id for i in have.values() if i.state in ("stopped", "stopping")]
        if stopped:
            I.start_stopped(self.api, region, stopped)
        ids = [i.instance_id for i in have.values()] + list(new.values())
        try:
            running = I.wait_running(self.api, region, ids, need_public=opts.public_ip,
                                     sleep=self.sleep, poll=self.poll)
            injected = {new[r]: (host[r][1],) for r in new if r in host}
            keys = self._host_keys(region, [i for i in new.values() if i not in injected],
                                   opts.host_key_wait)
            keys.update(injected)
            known = dict((self._record(request.name) or {}).get("host_keys") or {})
            known.update({i: list(k) for i, k in keys.items()})
            self._save(request.name, region=region, user=opts.ssh_user,
                       public_ip=opts.public_ip, host_keys=known)
            if self.amap is not None:
                self.amap.wait_for([a for i in running for a in (i.public_ip, i.private_ip) if a])
            return [self._node(i, keys.get(i.instance_id, ()), opts.ssh_user, opts.public_ip)
                    for i in running]
        except (CapacityError, QuotaError) as exc:
            if not self._rollback(region, list(new.values())):
                raise _stuck(exc) from exc
            raise
        except BaseException:
            self._rollback(region, list(new.values()))
            raise

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
            alive = [i.instance_id for i in I.describe_ids(self.api, region, ids)
                     if i.state not in ("shutting-down", "terminated")]
            I.terminate_ids(self.api, region, alive)
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
                found = pool.map(lambda i: (i, I.console_host_keys(self.api, region, i)), pending)
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

    def _node(self, i: I.Inst, host_keys: tuple[str, ...], user: str, public: bool) -> Node:
        addr = i.public_ip if public else i.private_ip
        status = I.STATUS.get(i.state, "unknown")
        if self.amap is None:
            return Node(rank=int(i.rank or 0), instance_id=i.instance_id, host=addr, port=22,
                        user=user, internal_ip=i.private_ip, status=status,  # type: ignore[arg-type]
                        host_keys=host_keys, root_dir="cloudtrain", spot=i.spot)
        # Test mode: only addresses the map gives are ever used.
        if not addr:
            return Node(rank=int(i.rank or 0), instance_id=i.instance_id, host="", user=user,
                        status=status, spot=i.spot)  # type: ignore[arg-type]
        what = f"node {i.rank} ({i.instance_id})"
        t = self.amap.resolve(addr, what)
        inner = self.amap.resolve(i.private_ip, what).host if i.private_ip else t.host
        return Node(rank=int(i.rank or 0), instance_id=i.instance_id, host=t.host, port=t.port,
                    user=str(self.amap.setting("user") or user), internal_ip=inner,
                    status=status, host_keys=host_keys,  # type: ignore[arg-type]
                    root_dir=t.root_dir or "cloudtrain", spot=i.spot)

    def list_nodes(self, cluster: str) -> list[Node]:
        rec = self._record(cluster) or {}
        user, public = str(rec.get("user") or "ubuntu"), bool(rec.get("public_ip", True))
        keys = rec.get("host_keys") or {}
        return [self._node(i, tuple(keys.get(i.instance_id) or ()), user, public)
                for i in self._live(cluster)]

    def master_port(self, cluster: str) -> int:
        if self.amap is not None and self.amap.setting("master_port"):
            return int(self.amap.setting("master_port"))
        return 29500

    def node_env(self, cluster: str) -> dict[str, str]:
        if self.amap is not None and self.amap.setting("python"):
            return {"CLOUDTRAIN_PYTHON": str(self.amap.setting("python"))}
        return {}

    # --- contract: terminate ---------------------------------------------------------------

    def enabled_regions(self) -> list[str]:
        found = self.api.call(self._default_region(), "describe_regions").get("Regions", [])
        return sorted(r["RegionName"] for r in found
                      if r.get("OptInStatus", "opt-in-not-required") != "not-opted-in")

    def _teardown(self, work: list[tuple[str, str, str | None]]) -> None:
        """Tear down (region, cluster, owner) triples in parallel; one error naming all."""
        def one(item: tuple[str, str, str | None]) -> str | None:
            region, cluster, owner = item
            try:
                TD.teardown_region(self.api, region, cluster, owner, sleep=self.sleep)
            except AuthError:
                raise
            except ProviderError as exc:
                return f"{region}: {exc.message}"
            return None

        if not work:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(work))) as pool:
            problems = [p for p in pool.map(one, work) if p]
        if problems:
            raise ProviderError("AWS teardown did not finish: " + " | ".join(problems),
                                "Run 'cloudtrain down' again; nothing was forgotten locally.")

    def terminate(self, cluster: str) -> None:
        rec = self._record(cluster)
        regions = list(rec["regions"]) if rec and rec.get("regions") else self.enabled_regions()
        self._teardown([(r, cluster, self._owner(cluster)) for r in regions])
        self._nets = {k: v for k, v in self._nets.items() if k[0] != cluster}

    # --- gc ------------------------------------------------------------------------------

    def gc_regions(self, all_regions: bool) -> list[str]:
        if all_regions:
            return self.enabled_regions()
        regions = {self._default_region()}
        clusters = self.ctx.home / "clusters"
        if clusters.is_dir():
            for f in clusters.glob(f"*/{RECORD}"):
                try:
                    regions.update(json.loads(f.read_text()).get("regions", []))
                except (OSError, ValueError):
                    continue
        return sorted(regions)

    def orphans(self, live: set[str], *, all_regions: bool = False,
                any_owner: bool = False) -> list[TD.Resource]:
        """Resources tagged by cloudtrain (this owner's, or anyone's with ``any_owner``) that
        no live cluster owns. ``live``: the names of this machine's AWS clusters."""
        regions = self.gc_regions(all_regions)
        owner = None if any_owner else self.owner

        def one(region: str) -> list[TD.Resource]:
            return TD.find(self.api, region, None, owner).resources

        with ThreadPoolExecutor(max_workers=min(8, len(regions))) as pool:
            found = [r for part in pool.map(one, regions) for r in part]
        return [r for r in found if not (r.cluster in live and r.owner == self._owner(r.cluster))]

    def remove(self, resources: list[TD.Resource]) -> None:
        """Remove what :meth:`orphans` found, cluster by cluster (instances first)."""
        groups = TD.group_by_cluster(resources)
        self._teardown([(region, cluster, owner or None) for (region, cluster, owner) in groups])


def _may_cluster_place(instance_type: str) -> bool:
    """For the plan (no API call): burstable and Mac types have no cluster placement groups.
    ``up`` asks EC2 (DescribeInstanceTypes) instead of guessing."""
    return not instance_type.startswith(("t2.", "t3.", "t3a.", "t4g.", "mac"))


def _interrupted(ended: list[I.Inst], live_ranks: set[int | None]) -> list[str]:
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
