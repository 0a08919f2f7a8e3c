"""What Compute Engine says of each node (ReportsNodeHealth), against the GCE REST fake through
the real clients: running; lost when preempted (TERMINATED + GCE's preempted operation, or
deleted), stopped, or missing; unknown on an API error; discard deletes only the named ranks
and provisioning again recreates exactly those ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.provider import ReportsNodeHealth  # noqa: E402
from cloudtrain_provisioners.gcp import tags as L  # noqa: E402
from gce_fake import Harness  # noqa: E402



def _mine(h: Harness, cluster: str = "demo") -> dict[int, tuple[str, str]]:
    """rank -> (zone, name) of the cluster's instances in the fake."""
    return {int(i["labels"][L.RANK]): (z, n) for (z, n), i in h.fake.instances.items()
            if i["labels"].get(L.CLUSTER) == cluster}


def test_running_preempted_stopped_missing_and_unknown(gcp: Harness) -> None:
    p, nodes = gcp.up(gcp.request(num_nodes=4, use_spot=True))
    assert isinstance(p, ReportsNodeHealth)
    fresh = gcp.provider()
    assert [(h.rank, h.state) for h in fresh.node_health("demo")] == [
        (r, "running") for r in range(4)]
    where = _mine(gcp)
    gcp.fake.preempt(*where[1], action="STOP")    # TERMINATED, with GCE's preempted record
    gcp.fake.guest_shutdown(*where[2])            # stopped, no preemption
    gcp.fake.preempt(*where[3])                   # the provider's spot VMs: deleted
    got = {h.rank: h for h in fresh.node_health("demo")}
    assert got[0].state == "running"
    assert got[1].state == "lost" and "preempted" in got[1].reason
    assert got[1].instance_id.startswith(where[1][1])
    assert got[2].state == "lost" and "TERMINATED" in got[2].reason \
        and "preempted" not in got[2].reason
    assert got[3].state == "lost" and f"{where[3][1]} was preempted" in got[3].reason
    gcp.fake._remove_instance(*where[0])          # deleted, not preempted: no record
    assert {h.rank: h for h in fresh.node_health("demo")}[0].reason.startswith("GCE lists no")

    gcp.fake.fail_http(403, "forbidden", "Required 'compute.instances.list' permission",
                       path="aggregated/instances")
    assert [(h.rank, h.state) for h in fresh.node_health("demo")] == [
        (r, "unknown") for r in range(4)]


def test_discard_deletes_only_those_ranks_and_up_recreates_them(gcp: Harness) -> None:
    p, nodes = gcp.up(gcp.request(num_nodes=3))
    gcp.up(gcp.request(name="other", num_nodes=2))
    other = _mine(gcp, "other")
    where = _mine(gcp)
    gcp.fake.preempt(*where[1], action="STOP")
    assert [h.state for h in p.node_health("demo")] == ["running", "lost", "running"]
    p.discard_nodes("demo", [1])
    assert set(_mine(gcp)) == {0, 2} and _mine(gcp, "other") == other
    inserts = len(gcp.fake.inserted_instances())
    _, again = gcp.up(gcp.request(num_nodes=3))
    new = gcp.fake.inserted_instances()[inserts:]
    assert [(b["name"], b["_zone"]) for b in new] == [(where[1][1], where[1][0])]
    assert new[0]["labels"][L.CLUSTER] == "demo" and new[0]["labels"][L.RANK] == "1"
    assert [n.instance_id for n in again][::2] == [n.instance_id for n in nodes][::2]
    assert [h.state for h in p.node_health("demo")] == ["running"] * 3
