"""``cloudtrain stop`` on GCP: ``instances.stop`` on the cluster's own instances (found by its
labels and owner), each operation waited for (the instance is then TERMINATED: stopped, its
boot disk kept). ``create_nodes`` starts them again (``instances.start``)."""

from __future__ import annotations

from .api import Api
from .instances import Inst
from .selfstop import STOPPED

STILL_BILLS = ("GCP: each node's boot disk still bills (persistent disk, per GB-month) while "
               "stopped; compute and GPU billing end, and the ephemeral external IPs are "
               "released (the nodes get new ones at start).")


def stop(api: Api, project: str, insts: list[Inst]) -> None:
    """Stop ``insts`` (the cluster's own) and wait for each operation."""
    ops = [(i, api.call("instances", "stop_unary", project=project, zone=i.zone,
                        instance=i.name))
           for i in insts if i.status not in STOPPED]
    for i, op in ops:
        api.wait(op, project=project, zone=i.zone, what=f"stopping {i.name}")
