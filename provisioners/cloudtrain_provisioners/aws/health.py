"""What EC2 says of each node of a cluster (``ReportsNodeHealth``), and clearing what a lost
node left so that ``create_nodes`` makes a fresh one in its rank.

Only EC2's own answer counts: ``running`` (or starting: ``pending``) is running even when SSH
to it fails; stopping/stopped/shutting-down/terminated, or no instance at all for a rank, is
lost, with EC2's state reason in words; an API error is unknown (not a loss).
"""

from __future__ import annotations

from typing import Callable

from cloudtrain.errors import ProviderError
from cloudtrain.provider import NodeHealth

from . import instances
from .api import Api

REASONS = {
    "Server.SpotInstanceTermination": "spot capacity taken back",
    "Server.SpotInstanceShutdown": "spot capacity taken back (stopped)",
    "Server.InsufficientInstanceCapacity": "no capacity to keep it running",
    "Server.InternalError": "an internal error of EC2",
    "Server.ScheduledStop": "a scheduled stop (retirement)",
    "Client.InstanceInitiatedShutdown": "it shut itself down",
    "Client.UserInitiatedShutdown": "stopped or terminated through the API",
    "Client.UserInitiatedHibernate": "hibernated through the API",
    "Client.VolumeLimitExceeded": "a volume limit",
    "Client.InternalError": "a client error at launch",
}


def reason_text(inst: instances.Inst) -> str:
    why = REASONS.get(inst.reason, inst.reason or "no reason given")
    return f"instance {inst.instance_id} is {inst.state}: {why}"


def judge(ranks: int, every: list[instances.Inst]) -> list[NodeHealth]:
    """One entry per rank ``0..ranks-1`` (and any higher rank found): the newest instance of
    each rank decides."""
    newest: dict[int, instances.Inst] = {}
    for i in sorted(every, key=lambda i: (i.launch_time, i.instance_id)):
        if i.rank is None:
            continue
        cur = newest.get(i.rank)
        # a live instance wins over an ended one of the same rank
        if cur is None or cur.state in ("shutting-down", "terminated") \
                or i.state not in ("shutting-down", "terminated"):
            newest[i.rank] = i
    out = []
    for rank in range(max([ranks, *(r + 1 for r in newest)])):
        inst = newest.get(rank)
        if inst is None:
            out.append(NodeHealth(rank, "", "lost", "EC2 lists no instance for this rank"))
        elif inst.state in ("running", "pending"):
            out.append(NodeHealth(rank, inst.instance_id, "running"))
        else:
            out.append(NodeHealth(rank, inst.instance_id, "lost", reason_text(inst)))
    return out


def node_health(api: Api, regions: list[str], cluster: str, owner: str,
                ranks: int) -> list[NodeHealth]:
    every: list[instances.Inst] = []
    try:
        for region in regions:
            every += instances.describe(api, region, cluster, owner,
                                        [*instances.LIVE_STATES, "terminated"])
    except ProviderError as exc:
        return [NodeHealth(r, "", "unknown", f"EC2 could not be asked: {exc.message}")
                for r in range(ranks)]
    return judge(ranks, every)


def discard(api: Api, regions: list[str], cluster: str, owner: str, ranks: list[int], *,
            sleep: Callable[[float], None]) -> list[str]:
    """Terminate what is left of ``ranks`` (found by the cluster's tags, then by id) and wait
    until EC2 says terminated. Returns the instance ids terminated."""
    wanted = set(ranks)
    done: list[str] = []
    for region in regions:
        left = [i for i in instances.describe(api, region, cluster, owner)
                if i.rank in wanted and i.cluster == cluster and i.state != "terminated"]
        ids = [i.instance_id for i in left]
        if not ids:
            continue
        instances.terminate_ids(api, region, [i.instance_id for i in left
                                              if i.state != "shutting-down"])
        instances.wait_terminated(api, region, ids, sleep=sleep, timeout=900.0)
        done += ids
    return done
