"""The cluster's network boundary on a VPC network: its firewall rules.

Every node carries the cluster's network tag (its base name). The rules, all INGRESS and
all aimed at that tag only, allow exactly:

- ``<base>-ssh``: TCP 22 from the caller's range (``resources.ssh_cidr``, else this
  machine's public address /32) -- never 0.0.0.0/0 unless the user's ssh_cidr says so;
- ``<base>-internal``: all traffic from instances carrying the same tag (NCCL, gloo, torch
  rendezvous between the nodes);
- ``<base>-ports``: the task's ``ports`` over TCP from the caller's range (only when there
  are any).

``ensure_firewalls`` reconciles: it creates missing rules, patches rules that differ, and
deletes this cluster's rules that are no longer wanted, so the rules match the task after
every ``up``.

Which network. A project's ``default`` network comes with ``default-allow-ssh`` (tcp:22 from
0.0.0.0/0) and ``default-allow-internal`` (everything from 10.128.0.0/9), both aimed at every
instance: on it, "SSH only from your address" would be false and the rendezvous/NCCL ports
(unauthenticated) would be open to every VM of the project. So by default each cluster gets
its own VPC network, ``<base>-net``, marked in its description like the rules, carrying
only cloudtrain's rules, and deleted at teardown (after the instances and rules, then
checked gone). It is an auto-mode network: GCE gives it a subnet in every region, so a
cluster can fail over from region to region without cloudtrain managing subnets, and GCE
adds no firewall rule to a network it did not create with the project. One per cluster
(not one per owner) so that no cluster's nodes can reach another's unauthenticated ports
and teardown removes all of it; the cost is one network of the project's quota (15 by
default) per live cluster.

When the task names a network (``resources.gcp.network``), ``audit_network`` reads its
firewall rules before anything is created and refuses one that is wider than cloudtrain's
own and applies to the nodes: an enabled INGRESS allow rule aimed at every instance (no
target tags or service accounts), at the cluster's tag, or at the nodes' service account,
that admits anything but tcp 22 / the task's ports from within the caller's range.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import UserError

from . import tags
from .api import Api, Conflict, NotFound


@dataclass(frozen=True)
class Rule:
    suffix: str                      # ssh | internal | ports
    protocol: str                    # tcp | all
    ports: tuple[str, ...]
    source_ranges: tuple[str, ...] = ()
    source_tags: tuple[str, ...] = ()

    def name(self, base: str) -> str:
        return f"{base}-{self.suffix}"

    def text(self, tag: str = "") -> str:
        what = "all traffic" if self.protocol == "all" else f"tcp {','.join(self.ports)}"
        src = (f"instances tagged {', '.join(self.source_tags)}" if self.source_tags
               else ", ".join(self.source_ranges))
        to = f" to instances tagged {tag}" if tag else ""
        return f"{what} from {src}{to}"


def desired_rules(base: str, cidr: str, ports: list[int]) -> list[Rule]:
    rules = [Rule("ssh", "tcp", ("22",), source_ranges=(cidr,)),
             Rule("internal", "all", (), source_tags=(base,))]
    if ports:
        rules.append(Rule("ports", "tcp", tuple(str(p) for p in sorted(set(ports))),
                          source_ranges=(cidr,)))
    return rules


def network_path(project: str, network: str) -> str:
    if "/" in network:
        return network
    return f"projects/{project}/global/networks/{network}"


def body(rule: Rule, base: str, project: str, network: str, cluster: str,
         owner: str) -> dict[str, Any]:
    allowed: dict[str, Any] = {"IPProtocol": rule.protocol}
    if rule.ports:
        allowed["ports"] = list(rule.ports)
    out: dict[str, Any] = {
        "name": rule.name(base), "network": network_path(project, network),
        "direction": "INGRESS", "priority": 1000, "allowed": [allowed],
        "targetTags": [base],
        "description": tags.description(cluster, owner, rule.text(base)),
    }
    if rule.source_ranges:
        out["sourceRanges"] = list(rule.source_ranges)
    if rule.source_tags:
        out["sourceTags"] = list(rule.source_tags)
    return out


def _same(have: dict[str, Any], want: dict[str, Any]) -> bool:
    def norm(fw: dict[str, Any]) -> tuple[Any, ...]:
        allowed = sorted((a.get("IPProtocol"), tuple(a.get("ports") or ()))
                         for a in fw.get("allowed") or [])
        return (tuple(allowed), tuple(sorted(fw.get("sourceRanges") or [])),
                tuple(sorted(fw.get("sourceTags") or [])),
                tuple(sorted(fw.get("targetTags") or [])), fw.get("direction", "INGRESS"),
                (fw.get("network") or "").rsplit("/", 1)[-1], bool(fw.get("disabled")))
    return norm(have) == norm(want)


def check_network(api: Api, project: str, network: str) -> None:
    m = re.search(r"projects/([^/]+)/global/networks/([^/]+)$", network)
    where, name = (m.group(1), m.group(2)) if m else (project, network)
    try:
        api.get("networks", "get", project=where, network=name)
    except NotFound:
        raise UserError(f"The VPC network '{network}' does not exist in project {project}.",
                        "Create it, or name an existing one in resources.gcp.network "
                        "(or leave it out: cloudtrain then creates one for the cluster).") from None


def dedicated_name(base: str) -> str:
    return f"{base}-net"


def find_networks(api: Api, project: str, cluster: str | None,
                  owner: str | None) -> list[dict[str, Any]]:
    """The VPC networks cloudtrain created for ``cluster`` of ``owner`` (None: any)."""
    out = []
    for net in api.items("networks", "list", project=project):
        m = tags.marks(net.get("description"))
        if not m or not str(net.get("name", "")).startswith("ct-"):
            continue
        if cluster is not None and m.get(tags.CLUSTER) != cluster:
            continue
        if owner is not None and m.get(tags.OWNER) != tags.owner_value(owner):
            continue
        out.append(net)
    return out


def ensure_dedicated_network(api: Api, project: str, base: str, cluster: str,
                             owner: str) -> str:
    """Create the cluster's own network (once); returns its name."""
    name = dedicated_name(base)
    try:
        have = api.get("networks", "get", project=project, network=name)
    except NotFound:
        have = None
    if have is not None:
        m = tags.marks(have.get("description"))
        if m.get(tags.CLUSTER) != cluster or m.get(tags.OWNER) != tags.owner_value(owner):
            raise UserError(f"A VPC network named {name} exists in project {project} and was "
                            "not created by cloudtrain for this cluster.",
                            "Rename or delete it, or use another cluster name.")
        return name
    body = {"name": name, "autoCreateSubnetworks": True,
            "description": tags.description(cluster, owner, "the cluster's own VPC network")}
    try:
        op = api.call("networks", "insert_unary", project=project,
                      network_resource=api.clients.message("Network", body))
    except Conflict:
        return ensure_dedicated_network(api, project, base, cluster, owner)
    api.wait(op, project=project, what=f"network {name}")
    return name


def delete_networks(api: Api, project: str, names: list[str]) -> None:
    for name in names:
        try:
            op = api.call("networks", "delete_unary", project=project, network=name)
            api.wait(op, project=project, what=f"deleting network {name}")
        except NotFound:
            continue


def _port_set(allowed: dict[str, Any]) -> set[int] | None:
    """The TCP ports an ``allowed`` entry admits (None: something other than TCP ports)."""
    if str(allowed.get("IPProtocol", "")).lower() not in ("tcp", "6"):
        return None
    ports = allowed.get("ports") or []
    if not ports:
        return None          # every TCP port
    out: set[int] = set()
    for p in ports:
        lo, _, hi = str(p).partition("-")
        a, b = int(lo), int(hi or lo)
        if b - a > 1024:
            return None
        out.update(range(a, b + 1))
    return out


def _within(ranges: list[str], cidr: str) -> bool:
    try:
        mine = ipaddress.ip_network(cidr, strict=False)
        return bool(ranges) and all(_inside(ipaddress.ip_network(r, strict=False), mine)
                                    for r in ranges)
    except ValueError:
        return False


def _inside(net: ipaddress.IPv4Network | ipaddress.IPv6Network,
            mine: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """Whether ``net`` lies within ``mine`` (never across IPv4 and IPv6)."""
    if isinstance(net, ipaddress.IPv4Network) and isinstance(mine, ipaddress.IPv4Network):
        return net.subnet_of(mine)
    if isinstance(net, ipaddress.IPv6Network) and isinstance(mine, ipaddress.IPv6Network):
        return net.subnet_of(mine)
    return False


def wider_rules(rules: list[dict[str, Any]], network: str, base: str, cidr: str,
                ports: list[int], service_account: str | None) -> list[tuple[dict[str, Any], str]]:
    """The rules of ``network`` that let more reach the nodes than cloudtrain's own would,
    each with what it admits in words."""
    ok_ports = {22, *ports}
    out = []
    for fw in rules:
        if (fw.get("network") or "").rsplit("/", 1)[-1] != network.rsplit("/", 1)[-1]:
            continue
        if fw.get("disabled") or (fw.get("direction") or "INGRESS") != "INGRESS":
            continue
        if not fw.get("allowed"):
            continue   # a deny rule only narrows
        targets, sas = fw.get("targetTags") or [], fw.get("targetServiceAccounts") or []
        if targets or sas:
            if base not in targets and not (service_account and service_account in sas):
                continue
            target = "the cluster's nodes"
        else:
            target = "every instance on the network"
        ranges = list(fw.get("sourceRanges") or [])
        other = list(fw.get("sourceTags") or []) + list(fw.get("sourceServiceAccounts") or [])
        if not ranges and other and set(other) <= {base}:
            continue   # from the cluster's own nodes (its internal rule)
        allowed_ports = [_port_set(a) for a in fw["allowed"]]
        if not other and _within(ranges, cidr) and all(
                p is not None and p <= ok_ports for p in allowed_ports):
            continue
        what = ", ".join(
            str(a.get("IPProtocol")) + (":" + ",".join(a["ports"]) if a.get("ports") else "")
            for a in fw["allowed"])
        src = ", ".join(ranges + [f"instances tagged/running as {o}" for o in other])
        out.append((fw, f"{what} from {src or 'anywhere'} to {target}"))
    return out


def audit_network(api: Api, project: str, network: str, base: str, cidr: str,
                  ports: list[int], service_account: str | None) -> None:
    """Refuse a user-named network on which a rule wider than ours reaches the nodes."""
    bad = wider_rules(api.items("firewalls", "list", project=project), network, base, cidr,
                      ports, service_account)
    if not bad:
        return
    names = [f["name"] for f, _ in bad]
    listed = "; ".join(f"{f['name']} admits {w}" for f, w in bad[:5])
    raise UserError(
        f"resources.gcp.network: on network '{network}' (project {project}) "
        f"{'the firewall rule' if len(bad) == 1 else f'{len(bad)} firewall rules are'} wider "
        f"than cloudtrain's own (SSH from {cidr} only, the rendezvous/NCCL ports only between "
        f"the cluster's nodes): {listed}" + ("; ..." if len(bad) > 5 else "")
        + ". Nothing was created.",
        "Leave resources.gcp.network out so that cloudtrain creates a network of the "
        "cluster's own, or narrow those rules (give them target tags the nodes do not carry, "
        f"or delete them: 'gcloud compute firewall-rules delete {' '.join(names)}').")


def find_rules(api: Api, project: str, cluster: str | None,
               owner: str | None) -> list[dict[str, Any]]:
    """The firewall rules cloudtrain created for ``cluster`` of ``owner`` (None: any)."""
    out = []
    for fw in api.items("firewalls", "list", project=project):
        m = tags.marks(fw.get("description"))
        if not m or not str(fw.get("name", "")).startswith("ct-"):
            continue
        if cluster is not None and m.get(tags.CLUSTER) != cluster:
            continue
        if owner is not None and m.get(tags.OWNER) != tags.owner_value(owner):
            continue
        out.append(fw)
    return out


def ensure_firewalls(api: Api, project: str, network: str, base: str, cluster: str, owner: str,
                     rules: list[Rule]) -> list[str]:
    """Make the cluster's rules exactly ``rules``. Returns the rule names."""
    wanted = {r.name(base): body(r, base, project, network, cluster, owner) for r in rules}
    existing = {fw["name"]: fw for fw in find_rules(api, project, cluster, owner)   # this network's
                if (fw.get("network") or "").rsplit("/", 1)[-1] == network.rsplit("/", 1)[-1]}
    ops: list[tuple[str, Any]] = []
    for name, want in wanted.items():
        have = existing.get(name)
        if have is None:
            try:
                ops.append((name, api.call("firewalls", "insert_unary", project=project,
                                           firewall_resource=api.clients.message("Firewall", want))))
            except Conflict:
                # named like ours but not found by its marks: someone else's rule
                have = api.get("firewalls", "get", project=project, firewall=name)
                if not tags.marks(have.get("description")):
                    raise UserError(f"A firewall rule named {name} exists in project {project} "
                                    "and was not created by cloudtrain.",
                                    "Rename or delete it, or use another cluster name.") from None
                if not _same(have, want):
                    ops.append((name, api.call("firewalls", "patch_unary", project=project,
                                               firewall=name,
                                               firewall_resource=api.clients.message("Firewall", want))))
        elif not _same(have, want):
            ops.append((name, api.call("firewalls", "patch_unary", project=project, firewall=name,
                                       firewall_resource=api.clients.message("Firewall", want))))
    for name in existing:
        if name not in wanted:
            ops.append((name, api.call("firewalls", "delete_unary", project=project,
                                       firewall=name)))
    for name, op in ops:
        api.wait(op, project=project, what=f"firewall rule {name}")
    return list(wanted)


def delete_rules(api: Api, project: str, names: list[str]) -> None:
    ops = []
    for name in names:
        try:
            ops.append((name, api.call("firewalls", "delete_unary", project=project,
                                       firewall=name)))
        except NotFound:
            continue
    for name, op in ops:
        try:
            api.wait(op, project=project, what=f"deleting firewall rule {name}")
        except NotFound:
            continue
