"""``cloudtrain stop`` on Azure: each of the cluster's own VMs (its resource group, its rank
and owner tags) is deallocated (compute stops billing; a VM only powered off still bills),
each operation waited for. ``create_nodes`` starts them again (``wait_running`` starts the
stopped ones): the same VMs, disks and static public IPs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .api import Api
from .instances import Vm

STILL_BILLS = ("Azure: each node's managed OS disk and its static public IP still bill while "
               "the VMs are deallocated; compute and GPU billing end.")


def stop(api: Api, group: str, vms: list[Vm]) -> None:
    """Deallocate ``vms`` (the cluster's own), all at once, and wait for each."""
    todo = [v for v in vms if v.power != "deallocated"]
    if not todo:
        return

    def one(v: Vm) -> None:
        api.lro(f"deallocate VM {v.name}", api.c.compute.virtual_machines.begin_deallocate,
                group, v.name)

    with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
        list(pool.map(one, todo))
