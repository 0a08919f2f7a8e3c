"""A new cluster whose provisioning fails is rolled back; an existing one is never touched."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from cloudtrain.context import open_env
from cloudtrain.pipeline.provision import provision
from cloudtrain.errors import CapacityError
from cloudtrain.provider import ClusterRequest, NetworkRef, Node, Plan
from cloudtrain.spec import parse_task
from cloudtrain.ui import UI


class HalfBuilt:
    """Creates its network, then runs out of capacity half-way through the nodes."""

    name: ClassVar[str] = "local"
    options_model = None
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = True

    def __init__(self) -> None:
        self.resources: set[str] = set()
        self.terminated = 0

    def check(self, request: ClusterRequest) -> None:
        pass

    def plan(self, request: ClusterRequest) -> Plan:
        return Plan(provider=self.name, num_nodes=request.num_nodes, hourly_price_per_node=2.0)

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        self.resources.add("sg")
        return NetworkRef("sg")

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        self.resources.add("node-0")
        raise CapacityError("no capacity for node 1 in zone a", "try another zone")

    def list_nodes(self, cluster: str) -> list[Node]:
        return [Node(0, "node-0", "127.0.0.1")] if "node-0" in self.resources else []

    def terminate(self, cluster: str) -> None:
        self.terminated += 1
        self.resources.clear()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> HalfBuilt:
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path))
    return HalfBuilt()


def test_failed_new_cluster_is_rolled_back(fake: HalfBuilt) -> None:
    env = open_env(UI(quiet=True), {"local": fake})
    task = parse_task("name: rb\nnum_nodes: 2\nrun: 'true'\n")
    with pytest.raises(CapacityError):
        provision(env, task, "rb")
    assert fake.terminated == 1 and fake.resources == set()
    assert env.state.get_cluster("rb") is None
    assert not (env.home / "clusters" / "rb").exists()
    # The interval opened nowhere: nothing was billed to the ledger for a cluster never up.
    assert [u for u in env.state.usage() if u.ended_at is None] == []


def test_keep_on_failure_keeps_what_was_built(fake: HalfBuilt) -> None:
    env = open_env(UI(quiet=True), {"local": fake})
    task = parse_task("name: rb\nnum_nodes: 2\nrun: 'true'\n")
    with pytest.raises(CapacityError):
        provision(env, task, "rb", keep_on_failure=True)
    assert fake.terminated == 0 and fake.resources == {"sg", "node-0"}
    row = env.state.get_cluster("rb")
    assert row is not None and row.status == "INIT"


class WithAttempts(HalfBuilt):
    """Tries two zones, both out of capacity, and remembers each attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.tried: list[dict[str, str]] = []

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        for zone in ("zone-a", "zone-b"):
            self.tried.append({"zone": zone, "outcome": "capacity",
                               "code": "InsufficientInstanceCapacity"})
        raise CapacityError("no capacity in zone-a or zone-b", "try another region")

    def attempts(self, cluster: str) -> list[dict[str, str]]:
        return list(self.tried)


def test_up_json_reports_every_attempt_and_the_error_when_up_fails(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from cloudtrain.commands.main import cli

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path))
    p = WithAttempts()
    task = tmp_path / "t.yaml"
    task.write_text("name: att\nnum_nodes: 2\nrun: 'true'\n")
    r = CliRunner().invoke(cli, ["up", str(task), "-y", "--json"], obj={"local": p})
    assert r.exit_code != 0
    doc = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    assert doc["ok"] is False and "no capacity" in doc["error"]
    assert [(a["provider"], a["zone"], a["outcome"]) for a in doc["attempts"]] == \
        [("local", "zone-a", "capacity"), ("local", "zone-b", "capacity")]
    assert p.terminated == 1, "the half-built cluster is rolled back"


def test_a_failed_spot_launch_is_named_an_interruption_when_the_provider_says_so() -> None:
    from types import SimpleNamespace

    from cloudtrain.pipeline.attempt import interruptions
    from cloudtrain.errors import TransientError

    class Spot:
        def interruptions(self, cluster: str) -> list[str]:
            return [f"node 1 of {cluster} (i-0abc, spot) was interrupted by AWS"]

    class Broken:
        def interruptions(self, cluster: str) -> list[str]:
            raise TransientError("throttled")

    assert interruptions(SimpleNamespace(provider=Spot()), "c") == \
        ["node 1 of c (i-0abc, spot) was interrupted by AWS"]
    assert interruptions(SimpleNamespace(provider=Broken()), "c") == []   # never hides the failure
    assert interruptions(SimpleNamespace(provider=object()), "c") == []   # providers without it
