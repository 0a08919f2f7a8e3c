"""``cloudtrain stop`` on AWS: StopInstances on the cluster's own instances (found by its tag
and owner), then waiting until EC2 says each is stopped. ``create_nodes`` starts them again
(StartInstances), the same instances with their EBS root volumes.

A spot instance of a one-time request cannot be stopped: refused before anything is called.
"""

from __future__ import annotations

import time
from typing import Callable

from cloudtrain.errors import ProviderError, UserError

from .api import Api
from .instances import BATCH, Inst, describe_ids

STILL_BILLS = ("AWS: each node's EBS root volume still bills (per GB-month) while stopped; "
               "compute and GPU billing end, and the public IPv4 addresses are released (the "
               "nodes get new ones at start).")


def stop(api: Api, insts: list[Inst], *, sleep: Callable[[float], None], poll: float,
         timeout: float = 900.0) -> None:
    """Stop ``insts`` (the cluster's own) and wait until each is stopped."""
    spot = [i for i in insts if i.spot]
    if spot:
        raise UserError(
            f"{len(spot)} node(s) of this cluster are spot instances (e.g. {spot[0].instance_id}"
            "), which EC2 cannot stop and start again (one-time spot requests).",
            "Tear the cluster down instead ('cloudtrain down'), or use on-demand nodes "
            "(use_spot: false) for a cluster you want to stop.")
    by_region: dict[str, list[str]] = {}
    for i in insts:
        if i.state not in ("stopped", "terminated"):
            by_region.setdefault(i.region, []).append(i.instance_id)
    for region, ids in by_region.items():
        for k in range(0, len(ids), BATCH):
            api.call(region, "stop_instances", InstanceIds=ids[k:k + BATCH])
    deadline = time.monotonic() + timeout
    for region, ids in by_region.items():
        while True:
            states = {i.instance_id: i.state for i in describe_ids(api, region, ids)}
            ended = [k for k, s in states.items() if s in ("shutting-down", "terminated")]
            if ended:
                raise ProviderError(f"instance(s) {', '.join(ended)} ended while stopping.",
                                    "See 'cloudtrain status --refresh'; 'cloudtrain down' "
                                    "removes what is left.")
            if all(states.get(k) == "stopped" for k in ids):
                break
            if time.monotonic() >= deadline:
                raise ProviderError(f"instance(s) in {region} did not stop within "
                                    f"{timeout:.0f}s.", "Run 'cloudtrain stop' again.")
            sleep(poll)
