"""What Compute Engine says of each node of a cluster (``ReportsNodeHealth``), and clearing
what a lost node left so that ``create_nodes`` makes a fresh one in its rank.

Only GCE's answer counts: RUNNING (or on its way: PROVISIONING, STAGING, REPAIRING) is
running, even when SSH to it fails. TERMINATED/STOPPING/SUSPENDED, or no instance for a rank
(a spot VM whose termination action is DELETE is simply gone), is lost. GCE does not mark a
preempted instance itself: it records a ``compute.instances.preempted`` operation in the
zone, which is where the reason "preempted" comes from; without one, a TERMINATED instance
was stopped (a guest shutdown, the console, a run-duration limit); a missing rank whose
instance name has such an operation was preempted and deleted. An API error: unknown.
"""

from __future__ import annotations

from cloudtrain.errors import CloudtrainError, ProviderError
from cloudtrain.provider import NodeHealth

from . import instances
from .api import Api

RUNNING = ("RUNNING", "PROVISIONING", "STAGING", "REPAIRING")
PREEMPTED_OP = "compute.instances.preempted"


def preempted(api: Api, project: str, zone: str) -> set[str]:
    """Names of the instances of ``zone`` GCE preempted (from its operations)."""
    ops = api.items("zone_operations", "list", request={
        "project": project, "zone": zone, "filter": f'operationType="{PREEMPTED_OP}"'})
    return {str(o.get("targetLink", "")).rsplit("/", 1)[-1] for o in ops
            if o.get("operationType") == PREEMPTED_OP}


def node_health(api: Api, project: str, cluster: str, owner: str,
                ranks: int) -> list[NodeHealth]:
    try:
        every = instances.describe(api, project, cluster, owner)
        newest: dict[int, instances.Inst] = {}
        for i in sorted(every, key=lambda i: (i.created_at, i.id)):
            if i.rank is not None and (i.rank not in newest or i.status in RUNNING):
                newest[i.rank] = i
        # a missing rank may be a spot VM deleted on preemption: its zone's record says so
        missing = any(r not in newest for r in range(ranks))
        zones = {i.zone for i in every if missing or i.status not in RUNNING}
        taken = {(z, n) for z in sorted(zones) for n in preempted(api, project, z)}
    except (ProviderError, CloudtrainError) as exc:
        return [NodeHealth(r, "", "unknown", f"GCE could not be asked: {exc.message}")
                for r in range(ranks)]
    base = next((i.name[:-len(f"-{i.rank}")] for i in every
                 if i.rank is not None and i.name.endswith(f"-{i.rank}")), None)
    out = []
    for rank in range(max([ranks, *(r + 1 for r in newest)])):
        inst = newest.get(rank)
        if inst is None:
            name = instances.instance_name(base, rank) if base else ""
            if any(n == name for _, n in taken):
                out.append(NodeHealth(rank, name, "lost", f"instance {name} was preempted by "
                                      "GCE (spot capacity taken back) and deleted"))
            else:
                out.append(NodeHealth(rank, "", "lost", "GCE lists no instance for this rank "
                                                        "(deleted, or a spot VM taken back)"))
            continue
        ident = f"{inst.name}/{inst.id}" if inst.id else inst.name
        if inst.status in RUNNING:
            out.append(NodeHealth(rank, ident, "running"))
        elif (inst.zone, inst.name) in taken:
            out.append(NodeHealth(rank, ident, "lost", f"instance {inst.name} was preempted "
                                  "by GCE (spot capacity taken back)"))
        else:
            when = f" at {inst.last_stop}" if inst.last_stop else ""
            out.append(NodeHealth(rank, ident, "lost",
                                  f"instance {inst.name} is {inst.status}{when}"))
    return out


def discard(api: Api, project: str, cluster: str, owner: str, ranks: list[int]) -> list[str]:
    """Delete the instances (and their auto-delete disks) of ``ranks``; returns their names."""
    wanted = set(ranks)
    by_zone: dict[str, list[str]] = {}
    for i in instances.describe(api, project, cluster, owner):
        if i.rank in wanted and i.cluster == cluster:
            by_zone.setdefault(i.zone, []).append(i.name)
    instances.delete(api, project, by_zone)
    return [n for names in by_zone.values() for n in names]
