"""Instances: what an insert asks for, launching a cluster's nodes in one zone, waiting for
them to run, finding them again by label, and removing them.

Each node is one instance named ``<base>-<rank>`` (so a second insert of the same rank is
refused by GCE with 409 rather than doubling a node), labelled with the cluster, rank and
owner, tagged with the cluster's network tag, with:

- ``scheduling.onHostMaintenance: TERMINATE`` (GPUs cannot live-migrate), and for spot
  ``provisioningModel: SPOT``, ``instanceTerminationAction: DELETE`` and no automatic
  restart (a preempted node is gone, and ``up`` replaces it);
- with the task's ``max_hours``: ``scheduling.maxRunDuration`` of that many hours (at least
  GCE's 30 s) and ``instanceTerminationAction: DELETE``, so GCE itself deletes the node and
  its boot disk when the hard lifetime is up, whatever happens to the node guard;
- a boot disk from the chosen image, of ``disk_size_gb``, labelled like the instance, with
  ``autoDelete`` (it goes when the instance goes);
- the cluster's SSH public key in the instance metadata (``ssh-keys``: ``user:key``), OS Login
  off for the instance (its keys would replace metadata keys), and the Deep Learning VM's
  ``install-nvidia-driver`` switch;
- no service account unless the task names one: the nodes get no Google credentials.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from cloudtrain.errors import CapacityError, ProviderError

from . import gpunics, tags
from .api import Api, Conflict, NotFound
from .images import Image, accelerator_type, builtin_gpus

STATUS = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running",
          "STOPPING": "stopped", "SUSPENDING": "stopped", "SUSPENDED": "stopped",
          "TERMINATED": "stopped", "REPAIRING": "pending"}


@dataclass(frozen=True)
class Inst:
    name: str
    zone: str
    status: str
    rank: int | None
    cluster: str
    owner: str
    nat_ip: str
    internal_ip: str
    machine_type: str
    spot: bool
    created_at: str
    id: str
    last_stop: str = ""
    """``lastStopTimestamp`` (RFC 3339): when the instance last stopped, e.g. on a guest
    shutdown."""

    @property
    def region(self) -> str:
        return self.zone.rsplit("-", 1)[0]


def parse(i: dict[str, Any]) -> Inst:
    marks = i.get("labels") or {}
    nics = i.get("networkInterfaces") or [{}]
    nat = next((ac.get("natIP", "") for ac in nics[0].get("accessConfigs") or []
                if ac.get("natIP")), "")
    rank_s = marks.get(tags.RANK, "")
    sched = i.get("scheduling") or {}
    return Inst(name=str(i.get("name", "")), zone=str(i.get("zone", "")).rsplit("/", 1)[-1],
                status=str(i.get("status", "")),
                rank=int(rank_s) if rank_s.isdigit() else None,
                cluster=marks.get(tags.CLUSTER, ""), owner=marks.get(tags.OWNER, ""),
                nat_ip=str(nat), internal_ip=str(nics[0].get("networkIP", "")),
                machine_type=str(i.get("machineType", "")).rsplit("/", 1)[-1],
                spot=sched.get("provisioningModel") == "SPOT",
                created_at=str(i.get("creationTimestamp", "")), id=str(i.get("id", "")),
                last_stop=str(i.get("lastStopTimestamp", "")))


@dataclass(frozen=True)
class LaunchSpec:
    project: str
    zone: str
    base: str
    machine_type: str
    accelerator: str | None          # a GPU model to attach (N1), None: none or built in
    accelerator_count: int
    image: Image
    disk_gb: int
    disk_type: str
    cluster: str
    owner: str
    spot: bool
    network: str
    subnetwork: str | None
    public_ip: bool
    ssh_user: str
    public_key: str
    service_account: str | None
    install_driver: bool
    max_run_seconds: int | None = None
    """GCE deletes the instance this long after it starts running (the hard lifetime)."""
    gpu_nics: tuple[gpunics.GpuNic, ...] = ()
    """A3's GPU NICs (GPUDirect-TCPX/TCPXO), each on its own network: gVNIC all."""
    placement_policy: str | None = None
    """The cluster's compact placement policy (compact.py), when it has one."""


def instance_name(base: str, rank: int) -> str:
    return f"{base}-{rank}"


def body(spec: LaunchSpec, rank: int) -> dict[str, Any]:
    """The Instance resource for one node, in the REST API's shape."""
    zone, project = spec.zone, spec.project
    lab = tags.labels(spec.cluster, spec.owner, rank)
    gpus = bool(spec.accelerator) or builtin_gpus(spec.machine_type)
    nic: dict[str, Any] = {"network": _net(project, spec.network)}
    if spec.subnetwork:
        nic["subnetwork"] = (spec.subnetwork if "/" in spec.subnetwork else
                             f"projects/{project}/regions/{zone.rsplit('-', 1)[0]}/"
                             f"subnetworks/{spec.subnetwork}")
    if spec.gpu_nics:
        nic["nicType"] = "GVNIC"   # A3: gVNIC on every interface
    if spec.public_ip:
        nic["accessConfigs"] = [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]
    sched: dict[str, Any] = {"onHostMaintenance": "TERMINATE" if gpus else "MIGRATE"}
    if spec.spot:
        sched.update({"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
                      "automaticRestart": False, "onHostMaintenance": "TERMINATE"})
    else:
        sched.update({"provisioningModel": "STANDARD", "automaticRestart": True})
    if spec.max_run_seconds:
        sched.update({"maxRunDuration": {"seconds": str(max(30, int(spec.max_run_seconds)))},
                      "instanceTerminationAction": "DELETE"})
    items = [{"key": "ssh-keys", "value": f"{spec.ssh_user}:{spec.public_key.strip()}"},
             {"key": "enable-oslogin", "value": "FALSE"},
             # the guest agent publishes the host's SSH public keys there (hostkeys/), so
             # cloudtrain pins them before its first connection (see host_keys below)
             {"key": "enable-guest-attributes", "value": "TRUE"}]
    if spec.install_driver and gpus:
        items.append({"key": "install-nvidia-driver", "value": "True"})
    out: dict[str, Any] = {
        "name": instance_name(spec.base, rank),
        "machineType": f"zones/{zone}/machineTypes/{spec.machine_type}",
        "labels": lab,
        "tags": {"items": [spec.base]},
        "scheduling": sched,
        "disks": [{"boot": True, "autoDelete": True, "type": "PERSISTENT",
                   "initializeParams": {"sourceImage": spec.image.source,
                                        "diskSizeGb": str(spec.disk_gb),
                                        "diskType": f"zones/{zone}/diskTypes/{spec.disk_type}",
                                        "labels": dict(lab)}}],
        "networkInterfaces": [nic, *gpunics.interfaces(project, list(spec.gpu_nics))],
        "metadata": {"items": items},
    }
    if spec.accelerator:
        out["guestAccelerators"] = [{
            "acceleratorType": f"projects/{project}/zones/{zone}/acceleratorTypes/"
                               f"{accelerator_type(spec.accelerator)}",
            "acceleratorCount": spec.accelerator_count}]
    if spec.placement_policy:
        out["resourcePolicies"] = [spec.placement_policy]
    if spec.service_account:
        out["serviceAccounts"] = [{"email": spec.service_account,
                                   "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}]
    return out


def _net(project: str, network: str) -> str:
    return network if "/" in network else f"projects/{project}/global/networks/{network}"


def describe(api: Api, project: str, cluster: str | None, owner: str | None) -> list[Inst]:
    """The instances labelled for ``cluster`` of ``owner`` (None: any), in every zone."""
    found = [parse(i) for i in api.aggregated("instances", project, "instances",
                                              tags.instance_filter(cluster, owner))]
    # the server filtered already; checked again here, since deleting is at stake
    return [i for i in found if i.cluster and (cluster is None or i.cluster == cluster)
            and (owner is None or i.owner == tags.owner_value(owner))]


def get(api: Api, project: str, zone: str, name: str) -> Inst | None:
    try:
        return parse(api.get("instances", "get", project=project, zone=zone, instance=name))
    except NotFound:
        return None


def launch(api: Api, spec: LaunchSpec, ranks: list[int]
           ) -> tuple[dict[int, str], dict[int, ProviderError]]:
    """Insert one instance per rank in ``spec.zone`` (in parallel) and wait for each insert
    to finish. Returns (rank -> name of what now exists, rank -> error)."""
    def one(rank: int) -> tuple[int, str | None, ProviderError | None]:
        name = instance_name(spec.base, rank)
        try:
            op = api.call("instances", "insert_unary", project=spec.project, zone=spec.zone,
                          instance_resource=api.clients.message("Instance", body(spec, rank)))
            api.wait(op, project=spec.project, zone=spec.zone,
                     what=f"creating {name} in {spec.zone}")
        except Conflict:
            return rank, name, None         # it exists (an earlier try): adopt it
        except ProviderError as exc:
            return rank, (name if get(api, spec.project, spec.zone, name) else None), exc
        return rank, name, None

    created: dict[int, str] = {}
    errors: dict[int, ProviderError] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(ranks)))) as pool:
        for rank, name, err in pool.map(one, ranks):
            if name:
                created[rank] = name
            if err is not None:
                errors[rank] = err
    return created, errors


def start(api: Api, project: str, zone: str, names: list[str]) -> None:
    ops = [(n, api.call("instances", "start_unary", project=project, zone=zone, instance=n))
           for n in names]
    for n, op in ops:
        api.wait(op, project=project, zone=zone, what=f"starting {n}")


def wait_running(api: Api, project: str, zone: str, names: list[str], *, need_public: bool,
                 sleep: Callable[[float], None], poll: float, timeout: float = 600.0
                 ) -> list[Inst]:
    """Wait until every instance is RUNNING (with its external address when
    ``need_public``). An instance that vanishes or stops while starting (a spot VM taken
    back at once) is a capacity problem of this zone."""
    deadline = time.monotonic() + timeout
    while True:
        found = {n: get(api, project, zone, n) for n in names}
        gone = [n for n, i in found.items() if i is None]
        ended = [n for n, i in found.items()
                 if i is not None and i.status in ("STOPPING", "TERMINATED", "SUSPENDED")]
        if gone or ended:
            raise CapacityError(
                f"{', '.join(gone + ended)} in {zone} "
                f"{'disappeared' if gone else 'stopped'} while starting (GCE took it back).",
                code="INSTANCE_ENDED_WHILE_STARTING")
        ready = [i for i in found.values()
                 if i is not None and i.status == "RUNNING" and (i.nat_ip or not need_public)]
        if len(ready) == len(names):
            return sorted(ready, key=lambda i: (i.rank is None, i.rank or 0))
        if time.monotonic() > deadline:
            slow = [f"{n} ({i.status if i else '?'})" for n, i in found.items()
                    if i not in ready]
            raise ProviderError(f"instances did not reach RUNNING in {timeout:.0f}s: "
                                + ", ".join(slow) + ".",
                                "Run 'cloudtrain up' again, or 'cloudtrain down' it.",
                                code="timeout")
        sleep(poll)


def delete(api: Api, project: str, by_zone: dict[str, list[str]]) -> None:
    """Delete instances and wait for each delete to finish (gone already is fine)."""
    ops = []
    for zone, names in by_zone.items():
        for n in names:
            try:
                ops.append((zone, n, api.call("instances", "delete_unary", project=project,
                                              zone=zone, instance=n)))
            except NotFound:
                continue
    for zone, n, op in ops:
        try:
            api.wait(op, project=project, zone=zone, what=f"deleting {n}")
        except NotFound:
            continue


_KEY_TYPE = re.compile(r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa)$")
_KEY_B64 = re.compile(r"^[A-Za-z0-9+/]+={0,3}$")


def host_keys(api: Api, project: str, zone: str, name: str) -> tuple[str, ...]:
    """The host public keys the guest agent published in the instance's guest attributes
    (``hostkeys/<type>``), as "type base64" lines; () while none is published."""
    try:
        d = api.get("instances", "get_guest_attributes",
                    request={"project": project, "zone": zone, "instance": name,
                             "query_path": "hostkeys/"})
    except NotFound:
        return ()
    out = []
    for item in (d.get("queryValue") or {}).get("items") or []:
        typ, val = str(item.get("key", "")), str(item.get("value", "")).strip()
        if item.get("namespace", "hostkeys") == "hostkeys" and _KEY_TYPE.match(typ) \
                and _KEY_B64.match(val):
            out.append(f"{typ} {val}")
    return tuple(sorted(out))


def wait_host_keys(api: Api, project: str, zone: str, names: list[str], wait: float,
                   sleep: Callable[[float], None], warn: Callable[[str], None]
                   ) -> dict[str, tuple[str, ...]]:
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
                    keys = host_keys(api, project, zone, n)
                    if keys:
                        found[n] = keys
        except ProviderError as exc:
            # e.g. no compute.instances.getGuestAttributes permission: not fatal, the
            # keys are then learned on first contact (and status says so)
            warn(f"gcp: cannot read the nodes' host keys from their guest "
                         f"attributes ({exc.message}).")
            break
        if len(found) == len(names) or waited >= wait:
            break
        sleep(step)
        waited += step
    missing = [n for n in names if n not in found]
    if missing:
        warn(f"gcp: {', '.join(missing)} published no SSH host key in its guest "
                     f"attributes within {wait:.0f} s; its key is learned on first contact.")
    return found
