"""What EC2 says of each node (ReportsNodeHealth) against moto: running, lost with EC2's reason
(spot taken back, stopped, terminated), unknown when EC2 cannot be asked; discard removes only
the named ranks and provisioning again recreates exactly those ranks with the cluster's tags."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from cloudtrain.provider import ReportsNodeHealth  # noqa: E402
from cloudtrain_provisioners.aws import tags as T  # noqa: E402
from aws_moto import Harness  # noqa: E402

REGION = "us-east-1"




def _up(h: Harness, req):  # type: ignore[no-untyped-def]
    p = h.provider()
    return p, p.create_nodes(req, p.ensure_network(req))


def _by_rank(h: Harness) -> dict[int, dict]:  # type: ignore[type-arg]
    return {int(T.as_dict(i["Tags"])[T.RANK]): i for i in h.tagged()["instances"]}


def test_running_lost_with_reason_and_unknown(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(num_nodes=3, use_spot=True))
    assert isinstance(p, ReportsNodeHealth)
    fresh = aws.provider()   # no cache: what EC2 says now
    assert [(h.rank, h.state) for h in fresh.node_health("demo")] == [
        (0, "running"), (1, "running"), (2, "running")]
    ids = {n.rank: n.instance_id for n in nodes}

    aws.faults.interrupt(REGION, ids[1])
    aws.clients.raw(REGION).stop_instances(InstanceIds=[ids[2]])
    got = {h.rank: h for h in fresh.node_health("demo")}
    assert got[0].state == "running" and got[0].instance_id == ids[0]
    assert got[1].state == "lost" and "spot capacity taken back" in got[1].reason
    assert got[1].instance_id == ids[1]
    assert got[2].state == "lost" and "stopped" in got[2].reason

    aws.faults.fail("DescribeInstances", "UnauthorizedOperation")
    assert {(h.rank, h.state) for h in fresh.node_health("demo")} == {
        (0, "unknown"), (1, "unknown"), (2, "unknown")}
    assert "could not be asked" in fresh.node_health("demo")[0].reason


def test_running_stays_running_when_ssh_would_fail(aws: Harness) -> None:
    """Health asks EC2 only: nothing here listens for SSH, and the nodes are running."""
    p, _ = _up(aws, aws.request(num_nodes=1))
    assert [h.state for h in p.node_health("demo")] == ["running"]


def test_discard_removes_only_those_ranks_and_up_recreates_them(aws: Harness) -> None:
    p, nodes = _up(aws, aws.request(num_nodes=3))
    ids = {n.rank: n.instance_id for n in nodes}
    raw = aws.clients.raw(REGION)
    raw.stop_instances(InstanceIds=[ids[1]])
    raw.terminate_instances(InstanceIds=[ids[2]])
    # another cluster's node of rank 1 is never touched
    _up(aws, aws.request(name="other", num_nodes=2))
    other = {r: i["InstanceId"] for r, i in _by_rank_of(aws, "other").items()}

    p.discard_nodes("demo", [1, 2])
    live = _by_rank(aws)
    assert {r: i["InstanceId"] for r, i in _by_rank_of(aws, "demo").items()} == {0: ids[0]}
    assert {r: i["InstanceId"] for r, i in _by_rank_of(aws, "other").items()} == other
    assert live  # the other cluster is still there

    p2, again = _up(aws, aws.request(num_nodes=3))
    now = {n.rank: n.instance_id for n in again}
    assert now[0] == ids[0] and now[1] not in ids.values() and now[2] not in ids.values()
    for r, inst in _by_rank_of(aws, "demo").items():
        marks = T.as_dict(inst["Tags"])
        assert marks[T.CLUSTER] == "demo" and marks[T.RANK] == str(r)
    assert [h.state for h in p2.node_health("demo")] == ["running"] * 3


def _by_rank_of(h: Harness, cluster: str) -> dict[int, dict]:  # type: ignore[type-arg]
    return {int(T.as_dict(i["Tags"])[T.RANK]): i
            for i in h.tagged(cluster=cluster)["instances"]}
