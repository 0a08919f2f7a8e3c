"""The GPU NICs of GCP's A3 machines: GPUDirect-TCPX (a3-highgpu-8g: 4 NICs) and
GPUDirect-TCPXO (a3-megagpu-8g: 8 NICs) move NCCL's traffic over extra gVNIC interfaces,
each on a VPC network of its own (GCE refuses two interfaces of one VM on one network).

Per cluster and GPU NIC ``i``, cloudtrain makes:

- the network ``<base>-g<i>``: custom mode (no subnet GCE adds), MTU 8244 as the recipe asks,
  marked in its description like the cluster's other networks and rules;
- its subnetwork ``<base>-g<i>`` in the region the nodes go to, ``10.<128+i>.<r>.0/24``
  (``r`` from the region's name, so a failover to another region does not overlap);
- its firewall rules, aimed at the cluster's tag like the main network's: ``<base>-g<i>-ssh``
  (tcp 22 from ``ssh_cidr``) and ``<base>-g<i>-int`` (all traffic from the network's own
  range ``10.<128+i>.0.0/16``, which only the cluster's nodes are in).

All are found by their marks and deleted at teardown (rules, then subnetworks, then the
networks). The project's NETWORKS quota (15 by default) counts them: an A3 Mega cluster
takes 9 networks; a quota refusal says so and how to avoid it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from cloudtrain.provider.fabric import Fabric
from cloudtrain.errors import QuotaError, UserError

from . import network, tags
from .api import Api, Conflict, NotFound

MTU = 8244


@dataclass(frozen=True)
class GpuNic:
    network: str
    subnetwork: str      # projects/P/regions/R/subnetworks/N
    cidr: str


def name(base: str, i: int) -> str:
    return f"{base}-g{i}"


def cidr(i: int, region: str) -> str:
    return f"10.{128 + i}.{zlib.crc32(region.encode()) % 256}.0/24"


def rules(i: int, ssh_cidr: str) -> list[network.Rule]:
    return [network.Rule(f"g{i}-ssh", "tcp", ("22",), source_ranges=(ssh_cidr,)),
            network.Rule(f"g{i}-int", "all", (), source_ranges=(f"10.{128 + i}.0.0/16",))]


def plan_lines(base: str, fab: Fabric, ssh_cidr: str) -> list[str]:
    return [f"{fab.links} GPU NIC VPC networks {name(base, 0)}..{fab.links - 1} for "
            f"{fab.title} (custom mode, MTU {MTU}; deleted at teardown), a subnetwork each in "
            f"the nodes' region, and on each the rules tcp 22 from {ssh_cidr} and all traffic "
            f"from the network's own range 10.(128+i).0.0/16 (the cluster's nodes only), to "
            f"instances tagged {base}"]


def plan_note(fab: Fabric) -> str:
    return (f"{fab.title} also needs Google's receive-datapath daemon and NCCL plugin running "
            "on each node (containers from Google's recipe; cloudtrain does not start them, "
            "bootstrap reports whether they are there); without them NCCL uses sockets on the "
            "primary NIC (docs/network.md)")


def _quota(exc: QuotaError, fab: Fabric) -> UserError:
    return UserError(
        f"GCP refused the {fab.title} networks: {exc.message} An {fab.links}-NIC cluster needs "
        f"{fab.links + 1} VPC networks (the project's NETWORKS quota is 15 by default). "
        "Nothing is left behind: 'cloudtrain down' removes what was made.",
        "Ask for more NETWORKS quota (IAM & Admin > Quotas), take down another A3 cluster, or "
        "set resources.network: plain (NCCL then uses the primary NIC only).")


def _ensure_network(api: Api, project: str, net: str, cluster: str, owner: str) -> None:
    try:
        api.get("networks", "get", project=project, network=net)
        return
    except NotFound:
        pass
    body = {"name": net, "autoCreateSubnetworks": False, "mtu": MTU,
            "description": tags.description(cluster, owner, "a GPU NIC network of the cluster")}
    try:
        op = api.call("networks", "insert_unary", project=project,
                      network_resource=api.clients.message("Network", body))
    except Conflict:
        return
    api.wait(op, project=project, what=f"network {net}")


def _ensure_subnet(api: Api, project: str, region: str, net: str, rng: str, cluster: str,
                   owner: str) -> None:
    try:
        api.get("subnetworks", "get", project=project, region=region, subnetwork=net)
        return
    except NotFound:
        pass
    body = {"name": net, "network": network.network_path(project, net), "ipCidrRange": rng,
            "description": tags.description(cluster, owner, "a GPU NIC subnetwork")}
    try:
        op = api.call("subnetworks", "insert_unary", project=project, region=region,
                      subnetwork_resource=api.clients.message("Subnetwork", body))
    except Conflict:
        return
    api.wait(op, project=project, region=region, what=f"subnetwork {net}")


def ensure(api: Api, project: str, region: str, base: str, cluster: str, owner: str,
           fab: Fabric, ssh_cidr: str) -> list[GpuNic]:
    """The cluster's GPU NIC networks, subnetworks (in ``region``) and rules, made where
    missing; one :class:`GpuNic` per NIC, in order."""
    out = []
    try:
        for i in range(fab.links):
            net, rng = name(base, i), cidr(i, region)
            _ensure_network(api, project, net, cluster, owner)
            _ensure_subnet(api, project, region, net, rng, cluster, owner)
            network.ensure_firewalls(api, project, net, base, cluster, owner, rules(i, ssh_cidr))
            out.append(GpuNic(net, f"projects/{project}/regions/{region}/subnetworks/{net}", rng))
    except QuotaError as exc:
        raise _quota(exc, fab) from None
    return out


def interfaces(project: str, nics: list[GpuNic]) -> list[dict[str, Any]]:
    """The instance's extra networkInterfaces: gVNIC, no external address."""
    return [{"network": network.network_path(project, n.network), "subnetwork": n.subnetwork,
             "nicType": "GVNIC"} for n in nics]


def find_subnetworks(api: Api, project: str, cluster: str | None,
                     owner: str | None) -> list[dict[str, Any]]:
    out = []
    for s in api.aggregated("subnetworks", project, "subnetworks", None):
        m = tags.marks(s.get("description"))
        if not m or not str(s.get("name", "")).startswith("ct-"):
            continue
        if cluster is not None and m.get(tags.CLUSTER) != cluster:
            continue
        if owner is not None and m.get(tags.OWNER) != tags.owner_value(owner):
            continue
        out.append(s)
    return out


def delete_subnetworks(api: Api, project: str, found: list[tuple[str, str]]) -> None:
    """Delete (region, name) subnetworks; gone already is fine."""
    ops = []
    for region, sub in found:
        try:
            ops.append((region, sub, api.call("subnetworks", "delete_unary", project=project,
                                              region=region, subnetwork=sub)))
        except NotFound:
            continue
    for region, sub, op in ops:
        try:
            api.wait(op, project=project, region=region, what=f"deleting subnetwork {sub}")
        except NotFound:
            continue


TCPX_ENV = {
    # GPUDirect-TCPX's NCCL settings from Google's recipe for A3 High (the CPU bindings left
    # out: they depend on the image's interface order); eth0 is the primary NIC. NCCL's
    # socket interface is the one bootstrap found carrying the cluster address.
    "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0",
    "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
    "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": "/run/tcpx",
    "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "50000",
    "NCCL_CROSS_NIC": "0", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
    "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "1", "NCCL_NET_GDR_LEVEL": "PIX",
    "NCCL_P2P_PXN_LEVEL": "0", "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    "NCCL_P2P_NET_CHUNKSIZE": "524288", "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576", "NCCL_BUFFSIZE": "4194304",
    "NCCL_MAX_NCHANNELS": "12", "NCCL_MIN_NCHANNELS": "12",
}
TCPXO_ENV = {
    # GPUDirect-TCPXO's (FasTrak) NCCL settings from Google's recipe for A3 Mega (the tuner
    # plugin's paths left out: they depend on where the image installs it).
    "NCCL_FASTRAK_CTRL_DEV": "eth0",
    "NCCL_FASTRAK_IFNAME": "eth1,eth2,eth3,eth4,eth5,eth6,eth7,eth8",
    "NCCL_FASTRAK_NUM_FLOWS": "2", "NCCL_FASTRAK_USE_SNAP": "1", "NCCL_FASTRAK_USE_LLCM": "1",
    "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0",
    "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000", "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PIX", "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    "NCCL_P2P_NET_CHUNKSIZE": "524288", "NCCL_P2P_PCI_CHUNKSIZE": "524288",
    "NCCL_P2P_NVL_CHUNKSIZE": "1048576", "NCCL_BUFFSIZE": "8388608", "NCCL_NVLS_ENABLE": "0",
}


def node_env(fab: Fabric) -> dict[str, str]:
    env = dict(TCPX_ENV if fab.kind == "gpudirect-tcpx" else TCPXO_ENV)
    env["CLOUDTRAIN_FABRIC"] = fab.kind
    env["CLOUDTRAIN_FABRIC_NICS"] = str(fab.links)
    return env
