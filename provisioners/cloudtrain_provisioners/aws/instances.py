"""Instances: how one node is launched, found again by tag, waited for and terminated.

Each rank is one ``RunInstances`` call carrying all its tags (instance, root volume, network
interface, spot request), so no instance ever exists without its cluster and rank. The calls
for the ranks of a cluster go out in parallel; describes and terminations are batched.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from cloudtrain.errors import CapacityError, ProviderError

from . import efa as efa_nics
from . import tags
from .api import Api
from .images import Image

LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
STATUS = {"pending": "pending", "running": "running", "stopping": "stopped",
          "stopped": "stopped", "shutting-down": "terminated", "terminated": "terminated"}
SPOT_REASONS = ("Server.SpotInstanceTermination", "Server.SpotInstanceShutdown")
CAPACITY_REASONS = ("Server.InsufficientInstanceCapacity",)
BATCH = 200
"""Instance ids per describe/terminate call (the API takes up to 1000)."""
MAX_PARALLEL = 16
"""RunInstances calls in flight at once (AWS's request-rate limits favour a bounded pool)."""


@dataclass(frozen=True)
class Inst:
    """One instance as described by EC2."""

    instance_id: str
    rank: int | None
    state: str
    zone: str
    region: str
    public_ip: str
    private_ip: str
    launch_time: str
    spot: bool
    reason: str
    instance_type: str
    key_name: str = ""
    cluster: str = ""
    owner: str = ""
    created_at: str = ""
    transition: str = ""
    """EC2's state transition reason, e.g. "User initiated (2026-11-24 01:02:03 GMT)"."""

    @property
    def interrupted(self) -> bool:
        return self.spot and self.reason in SPOT_REASONS


def parse(d: dict[str, Any], region: str) -> Inst:
    marks = tags.as_dict(d.get("Tags"))
    try:
        rank: int | None = int(marks.get(tags.RANK, ""))
    except ValueError:
        rank = None
    return Inst(
        instance_id=d["InstanceId"], rank=rank, state=d.get("State", {}).get("Name", "unknown"),
        zone=d.get("Placement", {}).get("AvailabilityZone", ""), region=region,
        public_ip=d.get("PublicIpAddress") or "", private_ip=d.get("PrivateIpAddress") or "",
        launch_time=str(d.get("LaunchTime") or ""),
        spot=d.get("InstanceLifecycle") == "spot",
        reason=(d.get("StateReason") or {}).get("Code", ""),
        instance_type=d.get("InstanceType", ""), key_name=d.get("KeyName") or "",
        cluster=marks.get(tags.CLUSTER, ""), owner=marks.get(tags.OWNER, ""),
        created_at=marks.get(tags.CREATED, ""),
        transition=str(d.get("StateTransitionReason") or ""))


def describe(api: Api, region: str, cluster: str | None, owner: str | None,
             states: list[str] | None = None) -> list[Inst]:
    flt = tags.filters(cluster, owner)
    flt.append({"Name": "instance-state-name", "Values": states or LIVE_STATES})
    return [parse(i, region) for r in api.pages(region, "describe_instances", "Reservations",
                                                Filters=flt)
            for i in r.get("Instances", [])]


def describe_ids(api: Api, region: str, ids: list[str]) -> list[Inst]:
    out = []
    for i in range(0, len(ids), BATCH):
        chunk = ids[i:i + BATCH]
        for r in api.pages(region, "describe_instances", "Reservations",
                           Filters=[{"Name": "instance-id", "Values": chunk}]):
            out += [parse(d, region) for d in r.get("Instances", [])]
    return out


# --- launching ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchSpec:
    """Everything a node's RunInstances needs, the same for every rank but the tags."""

    region: str
    zone: str
    subnet_id: str
    group_id: str
    key_name: str
    instance_type: str
    image: Image
    disk_gb: int
    cluster: str
    owner: str
    spot: bool = False
    spot_max_price: float | None = None
    placement_group: str | None = None
    efa: efa_nics.Layout | None = None
    """The node's EFA interfaces (None: one plain interface)."""
    public_ip: bool = True
    iam_instance_profile: str | None = None
    user_data: dict[int, str] | None = field(default=None, hash=False, compare=False)
    """cloud-init user data by rank (the node's host key, see the provider)."""
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    """Part of each call's ClientToken: a retried call returns the instance the first one
    made instead of making another; a new launch (new nonce) is never confused with an old."""


def run_params(spec: LaunchSpec, rank: int, created: str | None = None) -> dict[str, Any]:
    """The RunInstances request for one rank."""
    placement: dict[str, Any] = {"AvailabilityZone": spec.zone}
    if spec.placement_group:
        placement["GroupName"] = spec.placement_group
    kinds = ["instance", "volume", "network-interface"]
    if spec.spot:
        kinds.append("spot-instances-request")
    params: dict[str, Any] = {
        "ImageId": spec.image.image_id,
        "InstanceType": spec.instance_type,
        "MinCount": 1, "MaxCount": 1,
        "KeyName": spec.key_name,
        "NetworkInterfaces": efa_nics.interfaces(spec.efa, spec.subnet_id, spec.group_id,
                                                 spec.public_ip),
        "Placement": placement,
        "BlockDeviceMappings": [{"DeviceName": spec.image.root_device,
                                 "Ebs": {"VolumeSize": spec.disk_gb, "VolumeType": "gp3",
                                         "Encrypted": True, "DeleteOnTermination": True}}],
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": 1},
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": tags.spec(kinds, tags.tag_list(spec.cluster, spec.owner, rank, created)),
        "ClientToken": f"ct-{spec.nonce}-{rank}",
    }
    if spec.spot:
        opts: dict[str, Any] = {"SpotInstanceType": "one-time",
                                "InstanceInterruptionBehavior": "terminate"}
        if spec.spot_max_price is not None:
            opts["MaxPrice"] = f"{spec.spot_max_price:.4f}"
        params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": opts}
    if spec.iam_instance_profile:
        params["IamInstanceProfile"] = {"Name": spec.iam_instance_profile}
    if spec.user_data and rank in spec.user_data:
        params["UserData"] = spec.user_data[rank]   # botocore base64-encodes it
    return params


def launch(api: Api, spec: LaunchSpec, ranks: list[int]
           ) -> tuple[dict[int, str], dict[int, ProviderError]]:
    """Launch one instance per rank, in parallel. Returns (instance id by rank, error by
    rank): the caller decides what a partial launch means (it rolls it back)."""
    created = tags.now()

    def one(rank: int) -> str:
        resp = api.call(spec.region, "run_instances", where=spec.zone,
                        **run_params(spec, rank, created))
        return str(resp["Instances"][0]["InstanceId"])

    ids: dict[int, str] = {}
    errors: dict[int, ProviderError] = {}
    if not ranks:
        return ids, errors
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(ranks))) as pool:
        futures = {r: pool.submit(one, r) for r in ranks}
        for r, fut in futures.items():
            try:
                ids[r] = fut.result()
            except ProviderError as exc:
                errors[r] = exc
    return ids, errors


def wait_running(api: Api, region: str, ids: list[str], *, need_public: bool,
                 sleep: Callable[[float], None], timeout: float = 900.0,
                 poll: float = 3.0, attach: Callable[[Inst], None] | None = None) -> list[Inst]:
    """Until every instance runs (and has its public address when ``need_public``). An
    instance that ends instead raises CapacityError when AWS took it back for capacity (spot
    included), ProviderError otherwise. ``attach``: called once for each instance when it runs
    (a node with several interfaces gets its public address, an Elastic IP, then)."""
    deadline = time.monotonic() + timeout
    attached: set[str] = set()
    while True:
        found = {i.instance_id: i for i in describe_ids(api, region, ids)}
        ended = [i for i in found.values() if i.state in ("shutting-down", "terminated")]
        if ended:
            i = ended[0]
            what = (f"instance {i.instance_id} (node {i.rank}) in {i.zone} ended while starting: "
                    f"{i.reason or i.state}")
            code = i.reason or "InstanceEnded"
            if i.reason in CAPACITY_REASONS or i.interrupted:
                raise CapacityError(what + ".", "Another zone may have capacity.", code=code)
            raise ProviderError(what + ".", "See the instance's state reason in the EC2 console.",
                                code=code)
        fresh = [i for i in found.values()
                 if attach and i.state == "running" and i.instance_id not in attached]
        for i in fresh:
            attach(i)   # type: ignore[misc]
            attached.add(i.instance_id)
        if fresh:
            continue    # described again at once: their new addresses
        ready = [i for i in found.values()
                 if i.state == "running" and (i.public_ip or not need_public)]
        if len(ready) == len(ids):
            return sorted(ready, key=lambda i: (i.rank is None, i.rank or 0))
        if time.monotonic() >= deadline:
            late = sorted(set(ids) - {i.instance_id for i in ready})
            raise ProviderError(f"{len(late)} instance(s) in {region} did not start within "
                                f"{timeout:.0f}s: {', '.join(late[:5])}.",
                                "Run 'cloudtrain up' again (it adopts what runs) or 'down'.")
        sleep(poll)


def start_stopped(api: Api, region: str, ids: list[str]) -> None:
    for i in range(0, len(ids), BATCH):
        api.call(region, "start_instances", InstanceIds=ids[i:i + BATCH])


def terminate_ids(api: Api, region: str, ids: list[str]) -> None:
    for i in range(0, len(ids), BATCH):
        api.call(region, "terminate_instances", InstanceIds=ids[i:i + BATCH])


def wait_terminated(api: Api, region: str, ids: list[str], *, sleep: Callable[[float], None],
                    timeout: float = 900.0, poll: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = [i for i in describe_ids(api, region, ids) if i.state != "terminated"]
        if not left:
            return
        if time.monotonic() >= deadline:
            raise ProviderError(
                f"{len(left)} instance(s) in {region} were not terminated within {timeout:.0f}s: "
                + ", ".join(i.instance_id for i in left[:5]) + ".",
                "Run 'cloudtrain down' again; nothing was forgotten locally.")
        sleep(poll)


# --- host keys from the console -------------------------------------------------------------

HOST_KEY_BEGIN = "-----BEGIN SSH HOST KEY KEYS-----"
HOST_KEY_END = "-----END SSH HOST KEY KEYS-----"
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
             "ecdsa-sha2-nistp521", "ssh-rsa")


def parse_host_keys(text: str) -> tuple[str, ...]:
    """The host keys cloud-init prints between its BEGIN/END markers ("type base64"); the
    last block wins (a reboot prints them again)."""
    start = text.rfind(HOST_KEY_BEGIN)
    if start < 0:
        return ()
    end = text.find(HOST_KEY_END, start)
    if end < 0:
        return ()
    out = []
    for line in text[start + len(HOST_KEY_BEGIN):end].splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in KEY_TYPES and len(parts[1]) > 40:
            out.append(f"{parts[0]} {parts[1]}")
    return tuple(out)


def console_host_keys(api: Api, region: str, instance_id: str) -> tuple[str, ...]:
    """The host keys in the instance's console output now; () when none are there (yet).
    Asks for the latest output (Nitro types) and falls back to the buffered one."""
    for latest in (True, False):
        kw: dict[str, Any] = {"InstanceId": instance_id}
        if latest:
            kw["Latest"] = True
        try:
            out = api.call(region, "get_console_output", **kw).get("Output") or ""
        except ProviderError as exc:
            if latest and getattr(exc, "code", "") in ("UnsupportedOperation",
                                                      "InvalidParameterCombination"):
                continue
            return ()
        return parse_host_keys(out)
    return ()
