"""InfiniBand on Azure's ND sizes (ND A100 v4, NDm A100 v4, ND H100 v5): the VMs of a cluster
share one fabric only when Azure places them together, so a multi-node cluster on such a size
goes into one availability set of its own (``ct-avset``, Aligned, one fault and update
domain) inside a proximity placement group (``ct-ppg``), both in the cluster's resource group
and tagged like the rest of it (deleting the group removes them). A VM in an availability set
has no zone: Azure picks where the set lives.

The image is the Ubuntu HPC image (the default on these generation-2 sizes: OFED, the
InfiniBand drivers, NCCL and the NDv4/NDv5 topology files under /opt/microsoft), and every job
gets the NCCL/UCX settings Azure's own NCCL runs on these sizes use.
"""

from __future__ import annotations

from cloudtrain.provider.fabric import Fabric

from . import tags
from .api import Api, as_dict

AVSET = "ct-avset"
PPG = "ct-ppg"

TOPO_FILES = {"Standard_ND96asr_v4": "/opt/microsoft/ndv4-topo.xml",
              "Standard_ND96amsr_A100_v4": "/opt/microsoft/ndv4-topo.xml",
              "Standard_ND96isr_H100_v5": "/opt/microsoft/ndv5-topo.xml"}


def plan_line(fab: Fabric) -> str:
    return (f"proximity placement group {PPG} and availability set {AVSET} (Aligned) holding "
            f"every VM, so they share the {fab.title} fabric ({fab.links} ports per VM); the "
            "VMs get no zone")


def ensure_set(api: Api, group: str, region: str, cluster: str, owner: str) -> str:
    """The cluster's availability set (in its proximity placement group); its id."""
    tag_map = tags.tags(cluster, owner, "", None)
    ppg = as_dict(api.call(f"write proximity placement group {PPG} in {region}",
                           api.c.compute.proximity_placement_groups.create_or_update, group, PPG,
                           {"location": region, "tags": tag_map,
                            "properties": {"proximityPlacementGroupType": "Standard"}}))
    aset = as_dict(api.call(f"write availability set {AVSET} in {region}",
                            api.c.compute.availability_sets.create_or_update, group, AVSET,
                            {"location": region, "tags": tag_map, "sku": {"name": "Aligned"},
                             "properties": {"platformFaultDomainCount": 1,
                                            "platformUpdateDomainCount": 1,
                                            "proximityPlacementGroup": {"id": ppg["id"]}}}))
    return str(aset["id"])


def node_env(fab: Fabric, size: str) -> dict[str, str]:
    # NCCL_SOCKET_IFNAME: the interface bootstrap found carrying the cluster address (eth0)
    env = {"CLOUDTRAIN_FABRIC": fab.kind, "NCCL_IB_PCI_RELAXED_ORDERING": "1",
           "UCX_IB_PCI_RELAXED_ORDERING": "on",
           "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    for name, path in TOPO_FILES.items():
        if name.casefold() == size.casefold():
            env["NCCL_TOPO_FILE"] = path
    return env
