"""Network namespaces, veth pairs and a bridge: one separate network stack per local node."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cloudtrain.errors import ProviderError, UserError

SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")
NODE_IFACE = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ProviderError(f"'ip {' '.join(args)}' failed: {proc.stderr.strip()}",
                            "The netns mode needs root and iproute2; use 'network: loopback' otherwise.")
    return proc


def available() -> str | None:
    """None when netns mode can work here, else the reason it cannot."""
    import os

    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing"
    return None


def require() -> None:
    why = available()
    if why:
        raise UserError(f"resources.local.network is 'netns', but {why}.",
                        "Run as root with iproute2 installed, or use 'network: loopback'.")


@dataclass(frozen=True)
class Layout:
    tag: str            # short hex id of the cluster, names every link and namespace
    subnet: str         # e.g. 10.213.7.0/24

    @property
    def bridge(self) -> str:
        return f"ctbr{self.tag}"

    @property
    def gateway(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    def namespace(self, rank: int) -> str:
        return f"ct-{self.tag}-{rank}"

    def host_veth(self, rank: int) -> str:
        return f"ctv{self.tag}{rank}"

    def address(self, rank: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[10 + rank])


def used_subnets() -> set[str]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    used = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            net = ipaddress.ip_interface(parts[parts.index("inet") + 1]).network
            if isinstance(net, ipaddress.IPv4Network) and net.prefixlen >= 16 \
                    and net.subnet_of(SUBNET_POOL):
                used.add(str(ipaddress.ip_network(f"{net.network_address}/24", strict=False)))
    return used


def pick_subnet(prefer: int) -> str:
    used = used_subnets()
    subnets = list(SUBNET_POOL.subnets(new_prefix=24))
    for i in range(len(subnets)):
        cand = str(subnets[(prefer + i) % len(subnets)])
        if cand not in used:
            return cand
    raise ProviderError("no free /24 left in 10.213.0.0/16 for a local netns cluster.",
                        "Take down unused local clusters ('cloudtrain down -a').")


def create_bridge(layout: Layout) -> None:
    if _ip("link", "show", layout.bridge, check=False).returncode != 0:
        _ip("link", "add", layout.bridge, "type", "bridge")
    prefix = ipaddress.ip_network(layout.subnet).prefixlen
    _ip("addr", "replace", f"{layout.gateway}/{prefix}", "dev", layout.bridge)
    _ip("link", "set", layout.bridge, "up")


def write_hosts(layout: Layout, num_nodes: int, names: list[str]) -> None:
    """/etc/netns/<ns>/hosts, which 'ip netns exec' mounts over /etc/hosts inside the node:
    the nodes' addresses resolve (both ways) without any DNS."""
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{layout.address(r)} {names[r]}" for r in range(num_nodes)]
    for r in range(num_nodes):
        d = Path("/etc/netns") / layout.namespace(r)
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("\n".join(lines) + "\n")


def create_node(layout: Layout, rank: int) -> None:
    ns, veth = layout.namespace(rank), layout.host_veth(rank)
    if _ip("netns", "pids", ns, check=False).returncode != 0:
        _ip("netns", "add", ns)
    if _ip("link", "show", veth, check=False).returncode != 0:
        peer = f"ctp{layout.tag}{rank}"
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("-n", ns, "link", "set", peer, "name", NODE_IFACE)
    prefix = ipaddress.ip_network(layout.subnet).prefixlen
    _ip("link", "set", veth, "master", layout.bridge)
    _ip("link", "set", veth, "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("-n", ns, "addr", "replace", f"{layout.address(rank)}/{prefix}", "dev", NODE_IFACE)
    _ip("-n", ns, "link", "set", NODE_IFACE, "up")
    # No default route on purpose: a node reaches its cluster and this machine, nothing else
    # (and name lookups fail at once instead of timing out).


def namespace_exists(name: str) -> bool:
    return _ip("netns", "pids", name, check=False).returncode == 0


def namespace_pids(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def delete_node(layout: Layout, rank: int) -> None:
    ns = layout.namespace(rank)
    _ip("link", "del", layout.host_veth(rank), check=False)
    if namespace_exists(ns):
        _ip("netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def delete_bridge(layout: Layout) -> None:
    _ip("link", "del", layout.bridge, check=False)


def leftovers(layout: Layout, num_nodes: int) -> list[str]:
    left = []
    if _ip("link", "show", layout.bridge, check=False).returncode == 0:
        left.append(f"bridge {layout.bridge}")
    for r in range(num_nodes):
        if namespace_exists(layout.namespace(r)):
            left.append(f"namespace {layout.namespace(r)}")
        if (Path("/etc/netns") / layout.namespace(r)).exists():
            left.append(f"/etc/netns/{layout.namespace(r)}")
    return left


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]
