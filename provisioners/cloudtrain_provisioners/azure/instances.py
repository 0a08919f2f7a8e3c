"""How one node is made: a Standard static public IP, a NIC (accelerated networking where the
size supports it) and the VM (SSH key only, spot with eviction policy Delete), each a PUT
named after the cluster and rank, so a repeated call never makes a second one; and the
cluster's VMs and addresses as ARM lists them.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
import time
from typing import Any, Callable

from cloudtrain.errors import ProviderError, code_of

from . import tags
from .api import Api, as_dict

POWER = {"running": "running", "starting": "pending", "stopping": "stopped",
         "stopped": "stopped", "deallocating": "stopped", "deallocated": "stopped"}


# --- a node's pieces --------------------------------------------------------------------------------

def ensure_public_ip(api: Api, group: str, region: str, name: str, tag_map: dict[str, str]) -> str:
    """A Standard static IPv4 address (zone-redundant where the region has zones, so it
    serves a VM in any zone)."""
    pip = as_dict(api.lro(f"write public IP {name} in {region}",
                          api.c.network.public_ip_addresses.begin_create_or_update, group, name,
                          {"location": region, "tags": tag_map,
                           "sku": {"name": "Standard", "tier": "Regional"},
                           "properties": {"publicIPAllocationMethod": "Static",
                                          "publicIPAddressVersion": "IPv4"}}))
    return str(pip["id"])


def ensure_nic(api: Api, group: str, region: str, name: str, subnet_id: str,
               public_ip_id: str | None, accelerated: bool, tag_map: dict[str, str]) -> str:
    ipc: dict[str, Any] = {"subnet": {"id": subnet_id}, "privateIPAllocationMethod": "Dynamic",
                           "primary": True}
    if public_ip_id:
        ipc["publicIPAddress"] = {"id": public_ip_id}
    nic = as_dict(api.lro(f"write network interface {name} in {region}",
                          api.c.network.network_interfaces.begin_create_or_update, group, name,
                          {"location": region, "tags": tag_map,
                           "properties": {"enableAcceleratedNetworking": accelerated,
                                          "ipConfigurations": [{"name": "ipconfig1",
                                                                "properties": ipc}]}}))
    return str(nic["id"])


@dataclass(frozen=True)
class VmSpec:
    """What every node's VM has in common."""

    region: str
    group: str
    size: str
    image: dict[str, str]
    disk_gb: int
    premium_disk: bool
    user: str
    public_key: str
    cluster: str
    owner: str
    spot: bool = False
    spot_max_price: float | None = None
    identity: bool = False
    """A system-assigned managed identity (the node guard's self-stop, see selfstop.py)."""
    availability_set: str | None = None
    """The cluster's availability set (InfiniBand sizes, see ibfabric.py): no zone then."""


def vm_body(spec: VmSpec, rank: int, nic_id: str, zone: str | None,
            created: str | None = None, custom_data: str | None = None) -> dict[str, Any]:
    """The VM's PUT body for one rank. ``custom_data``: cloud-init user data (the node's
    host key, see the provider), passed base64-encoded as ARM wants it."""
    name = tags.vm_name(spec.cluster, rank)
    props: dict[str, Any] = {
        "hardwareProfile": {"vmSize": spec.size},
        "storageProfile": {
            "imageReference": dict(spec.image),
            "osDisk": {"name": tags.disk_name(spec.cluster, rank), "createOption": "FromImage",
                       "caching": "ReadWrite", "diskSizeGB": spec.disk_gb,
                       "deleteOption": "Delete",
                       "managedDisk": {"storageAccountType":
                                       "Premium_LRS" if spec.premium_disk else "StandardSSD_LRS"}},
        },
        "osProfile": {
            "computerName": name, "adminUsername": spec.user,
            "linuxConfiguration": {
                "disablePasswordAuthentication": True, "provisionVMAgent": True,
                "ssh": {"publicKeys": [{"path": f"/home/{spec.user}/.ssh/authorized_keys",
                                        "keyData": spec.public_key.strip()}]}},
        },
        "networkProfile": {"networkInterfaces": [
            {"id": nic_id, "properties": {"primary": True, "deleteOption": "Detach"}}]},
        "diagnosticsProfile": {"bootDiagnostics": {"enabled": True}},
    }
    if custom_data is not None:
        props["osProfile"]["customData"] = base64.b64encode(custom_data.encode()).decode()
    if spec.availability_set:
        props["availabilitySet"] = {"id": spec.availability_set}
    if spec.spot:
        props["priority"] = "Spot"
        props["evictionPolicy"] = "Delete"
        props["billingProfile"] = {"maxPrice": spec.spot_max_price if spec.spot_max_price else -1}
    body: dict[str, Any] = {"location": spec.region,
                            "tags": tags.tags(spec.cluster, spec.owner, rank, created),
                            "properties": props}
    if zone and not spec.availability_set:
        body["zones"] = [zone]
    if spec.identity:
        body["identity"] = {"type": "SystemAssigned"}
    return body


# --- what exists -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Vm:
    name: str
    id: str
    rank: int | None
    location: str
    zone: str | None
    size: str
    state: str           # provisioning state: Creating, Succeeded, Failed, Deleting ...
    power: str           # running, starting, stopped, deallocated ... ("" unknown)
    spot: bool
    nic_id: str
    disk_name: str
    cluster: str
    owner: str
    created_at: str
    principal: str = ""
    """The system-assigned identity's principal id ("" without one)."""
    guard_stop: str = ""
    """The tag a node's guard leaves before it deallocates its VM: "<reason> <epoch>"."""
    state_time: str = ""
    """When the VM's last operation ended (the instance view's ProvisioningState time)."""

    @property
    def status(self) -> str:
        if self.state in ("Deleting",):
            return "terminated"
        if self.state in ("Creating",) or (self.state == "Updating" and not self.power):
            return "pending"
        if self.state == "Failed":
            return "unknown"
        return POWER.get(self.power, "unknown")


def parse_vm(d: dict[str, Any]) -> Vm:
    p = d.get("properties") or {}
    tg = d.get("tags") or {}
    power = state_time = ""
    for s in (p.get("instanceView") or {}).get("statuses") or []:
        code = str(s.get("code", ""))
        if code.startswith("PowerState/"):
            power = code.split("/", 1)[1]
        elif code.startswith("ProvisioningState/") and s.get("time"):
            state_time = str(s["time"])
    nics = (p.get("networkProfile") or {}).get("networkInterfaces") or [{}]
    osd = (p.get("storageProfile") or {}).get("osDisk") or {}
    return Vm(name=str(d.get("name")), id=str(d.get("id")), rank=tags.rank_of(tg),
              location=str(d.get("location", "")), zone=(d.get("zones") or [None])[0],
              size=str((p.get("hardwareProfile") or {}).get("vmSize", "")),
              state=str(p.get("provisioningState", "")), power=power,
              spot=p.get("priority") == "Spot", nic_id=str(nics[0].get("id", "")),
              disk_name=str(osd.get("name", "")), cluster=tg.get(tags.CLUSTER, ""),
              owner=tg.get(tags.OWNER, ""), created_at=tg.get(tags.CREATED, ""),
              principal=str((d.get("identity") or {}).get("principalId") or ""),
              guard_stop=tg.get(tags.GUARD_STOP, ""), state_time=state_time)


def delete_vms(api: Api, group: str, names: list[str], workers: int = 16) -> None:
    """Delete VMs (in parallel; gone already is fine). Their OS disks go with them."""
    def one(vm: str) -> None:
        try:
            api.lro(f"delete VM {vm}", api.c.compute.virtual_machines.begin_delete, group, vm)
        except ProviderError as exc:
            if code_of(exc) not in ("ResourceNotFound", "NotFound", "ResourceGroupNotFound"):
                raise

    if names:
        with ThreadPoolExecutor(max_workers=min(workers, len(names))) as pool:
            list(pool.map(one, names))


def wait_running(api: Api, group: str, timeout: float, poll: float,
                 sleep: Callable[[float], None], n: int) -> list[Vm]:
    """Until the ``n`` ranks' VMs run (stopped ones are started); a failed one is an error."""
    deadline = time.monotonic() + timeout
    while True:
        found = [v for v in list_vms(api, group) if v.rank is not None and v.rank < n]
        failed = [v for v in found if v.state == "Failed" or v.status == "terminated"]
        if failed:
            raise ProviderError(f"VM {failed[0].name} is {failed[0].state or failed[0].power} "
                                "instead of running.", "Run 'cloudtrain up' again, or 'down'.")
        stopped = [v for v in found if v.status == "stopped"]
        for v in stopped:
            api.lro(f"start VM {v.name}", api.c.compute.virtual_machines.begin_start, group,
                    v.name)
        ready = [v for v in found if v.status == "running"]
        if len(ready) == n and len({v.rank for v in ready}) == n:
            return sorted(ready, key=lambda v: v.rank or 0)
        if time.monotonic() >= deadline:
            raise ProviderError(f"{n - len(ready)} VM(s) of {group} did not start within "
                                f"{timeout:.0f}s.",
                                "Run 'cloudtrain up' again (it adopts what runs) or 'down'.")
        sleep(poll)


def list_vms(api: Api, group: str) -> list[Vm]:
    try:
        found = api.items(f"list VMs of {group}", api.c.compute.virtual_machines.list, group,
                          expand="instanceView")
    except ProviderError as exc:
        if code_of(exc) == "ResourceGroupNotFound":
            return []
        raise
    return [parse_vm(as_dict(v)) for v in found]


@dataclass(frozen=True)
class Addresses:
    public: str
    private: str


def addresses(api: Api, group: str) -> dict[str, Addresses]:
    """NIC id (lower case) -> its private address and its public IP's address."""
    try:
        nics = [as_dict(n) for n in api.items(f"list NICs of {group}",
                                               api.c.network.network_interfaces.list, group)]
        pips = {str(as_dict(p)["id"]).lower(): as_dict(p) for p in
                api.items(f"list public IPs of {group}", api.c.network.public_ip_addresses.list,
                          group)}
    except ProviderError as exc:
        if code_of(exc) == "ResourceGroupNotFound":
            return {}
        raise
    out = {}
    for n in nics:
        cfg = (((n.get("properties") or {}).get("ipConfigurations") or [{}])[0].get("properties")
               or {})
        pip = pips.get(str((cfg.get("publicIPAddress") or {}).get("id", "")).lower()) or {}
        out[str(n["id"]).lower()] = Addresses(
            public=str((pip.get("properties") or {}).get("ipAddress") or ""),
            private=str(cfg.get("privateIPAddress") or ""))
    return out
