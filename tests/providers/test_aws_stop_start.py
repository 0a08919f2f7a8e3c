"""``cloudtrain stop`` / ``start`` on AWS against moto: stop (through the CLI, the emulator's
provider handed in) stops exactly the cluster's own instances, tagged and owned by it, and
waits until EC2 says they are stopped; the state records STOPPED and the ledger's interval
closes as "stopped"; starting (up's provisioning from the cluster's record) starts the same
instances, re-pinning their host keys at their addresses; spot nodes are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from click.testing import CliRunner  # noqa: E402

from cloudtrain.context import Env, open_env  # noqa: E402
from cloudtrain.keys import host_entry_name  # noqa: E402
from cloudtrain.pipeline import stopstart  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from aws_moto import Harness  # noqa: E402

REGION = "us-east-1"
TASK = """
name: {name}
num_nodes: {n}
run: echo hi
resources:
  provider: aws
  region: us-east-1
  accelerators: A100:8
  use_spot: {spot}
  aws: {{host_key_wait: 0}}
"""


@pytest.fixture
def home(aws: Harness, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(aws.home))
    return aws.home


def _env(h: Harness) -> Env:
    return open_env(UI(quiet=True), {"aws": h.provider()})


def _up(h: Harness, name: str, n: int = 2, spot: bool = False) -> list[str]:
    task = parse_task(TASK.format(name=name, n=n, spot="true" if spot else "false"))
    handle, _ = provision(_env(h), task, name)
    return [n.instance_id for n in handle.nodes]


def _cli(h: Harness, *args: str) -> Any:
    from cloudtrain.commands.main import cli

    return CliRunner().invoke(cli, list(args), obj={"aws": h.provider()})


def _states(h: Harness) -> dict[str, str]:
    raw = h.clients.raw(REGION)
    return {i["InstanceId"]: i["State"]["Name"]
            for r in raw.describe_instances()["Reservations"] for i in r["Instances"]}


def test_stop_stops_only_the_clusters_own_instances(aws: Harness, home: Path) -> None:
    demo = _up(aws, "demo")
    other = _up(aws, "other", n=1)
    raw = aws.clients.raw(REGION)
    image = raw.describe_instances(InstanceIds=[demo[0]])["Reservations"][0]["Instances"][0][
        "ImageId"]
    stranger = raw.run_instances(ImageId=image, MinCount=1, MaxCount=1, InstanceType="t3.micro",
                                 TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                     {"Key": "cloudtrain:cluster", "Value": "demo"}]}]
                                 )["Instances"][0]["InstanceId"]   # our tag, not our owner mark
    aws.faults.calls.clear()

    r = _cli(aws, "stop", "demo", "-y", "--force")
    assert r.exit_code == 0, r.output
    assert "Cluster 'demo' is stopped: compute no longer bills" in r.output
    assert "EBS root volume still bills" in r.output
    states = _states(aws)
    assert [states[i] for i in demo] == ["stopped", "stopped"]
    assert states[other[0]] == "running" and states[stranger] == "running"
    assert [sorted(o["InstanceIds"]) for o in aws.faults.ops("StopInstances")] == [sorted(demo)]

    st = {c["name"]: c for c in json.loads(_cli(aws, "status", "--json").output)}
    assert st["demo"]["status"] == "STOPPED" and st["other"]["status"] == "UP"
    assert [n["status"] for n in st["demo"]["nodes"]] == ["stopped", "stopped"]
    env = _env(aws)
    last = env.state.usage("demo")[-1]
    assert last.ended_at is not None and last.end_reason == "stopped"
    assert env.state.usage("other")[-1].ended_at is None

    r = _cli(aws, "stop", "demo", "-y")          # twice: nothing more is called
    assert r.exit_code == 0 and "stopped already" in r.output
    assert len(aws.faults.ops("StopInstances")) == 1

    # start: the same instances, started (nothing launched), host keys pinned again
    aws.faults.calls.clear()
    row = env.state.get_cluster("demo")
    assert row is not None
    handle, fresh = provision(env, stopstart.task_of(row), "demo")
    assert not fresh and [n.instance_id for n in handle.nodes] == demo
    assert [sorted(o["InstanceIds"]) for o in aws.faults.ops("StartInstances")] == [sorted(demo)]
    assert not aws.faults.ops("RunInstances")
    assert [states[i] for i in demo] != [_states(aws)[i] for i in demo]
    assert {_states(aws)[i] for i in demo} == {"running"}
    pinned = handle.keys.known_hosts.read_text()
    for n in handle.nodes:
        assert f"{host_entry_name(n.host, n.port)} ssh-ed25519 " in pinned
    assert env.state.get_cluster("demo").status == "UP"  # type: ignore[union-attr]
    assert env.state.usage("demo")[-1].ended_at is None   # billing again, a new interval
    assert len(env.state.usage("demo")) == 2


def test_spot_nodes_are_refused_and_left_running(aws: Harness, home: Path) -> None:
    ids = _up(aws, "spotty", n=1, spot=True)
    aws.faults.calls.clear()
    r = _cli(aws, "stop", "spotty", "-y", "--force")
    assert r.exit_code == 2, r.output
    assert "spot instances" in r.output and "cloudtrain down" in r.output
    assert "Traceback" not in r.output
    assert _states(aws)[ids[0]] == "running"
    assert not aws.faults.ops("StopInstances")
    st = json.loads(_cli(aws, "status", "--json").output)
    assert st[0]["status"] == "UP"
