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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import UserError

from . import labels as L
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
        "description": L.description(cluster, owner, rule.text(base)),
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
                        "(default: 'default').") from None


def find_rules(api: Api, project: str, cluster: str | None,
               owner: str | None) -> list[dict[str, Any]]:
    """The firewall rules cloudtrain created for ``cluster`` of ``owner`` (None: any)."""
    out = []
    for fw in api.items("firewalls", "list", project=project):
        m = L.marks(fw.get("description"))
        if not m or not str(fw.get("name", "")).startswith("ct-"):
            continue
        if cluster is not None and m.get(L.CLUSTER) != cluster:
            continue
        if owner is not None and m.get(L.OWNER) != L.owner_value(owner):
            continue
        out.append(fw)
    return out


def ensure_firewalls(api: Api, project: str, network: str, base: str, cluster: str, owner: str,
                     rules: list[Rule]) -> list[str]:
    """Make the cluster's rules exactly ``rules``. Returns the rule names."""
    wanted = {r.name(base): body(r, base, project, network, cluster, owner) for r in rules}
    existing = {fw["name"]: fw for fw in find_rules(api, project, cluster, owner)}
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
                if not L.marks(have.get("description")):
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
