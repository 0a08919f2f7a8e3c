"""cloudtrain.testing.MemoryProvider: the in-memory provider shipped for tests keeps the
provider contract, and is handed in through the Env (or the command line's context object),
never registered globally."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloudtrain.commands.main import cli
from cloudtrain.context import Env, open_env
from cloudtrain.errors import CapacityError, QuotaError
from cloudtrain.provider import registry
from cloudtrain.provider.contract import ClusterRequest, NetworkRef, Provider
from cloudtrain.spec import parse_task
from cloudtrain.state import open_state
from cloudtrain.testing import MemoryProvider
from cloudtrain.ui import UI


def _request(name: str = "c", n: int = 2) -> ClusterRequest:
    task = parse_task(f"name: {name}\nnum_nodes: {n}\nresources: {{instance_type: m1, "
                      f"region: r1, provider: aws}}\nrun: x\n")
    return ClusterRequest(name=name, num_nodes=n, resources=task.resources, options=None,
                          public_key="ssh-ed25519 AAAA test")


def _env(tmp_path: Path, **providers: Provider) -> Env:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return Env(home, open_state(home), UI(quiet=True), providers=providers)


def test_it_keeps_the_provider_contract() -> None:
    p = MemoryProvider()
    assert isinstance(p, Provider) and p.name == "memory"
    aws = MemoryProvider.named("aws", price=3.5)
    assert isinstance(aws, Provider) and isinstance(aws, MemoryProvider)
    assert aws.name == "aws" and type(aws).name == "aws" and MemoryProvider.name == "memory"
    plan = aws.plan(_request())
    assert (plan.provider, plan.num_nodes, plan.region, plan.instance_type) == \
        ("aws", 2, "r1", "m1")
    assert plan.hourly_price_per_node == 3.5 and plan.creates == ["2 x m1 in r1"]


def test_nodes_live_in_memory_and_create_is_idempotent() -> None:
    p = MemoryProvider.named("gcp")
    req = _request()
    net = p.ensure_network(req)
    assert p.ensure_network(req) == net and p.networks == {"c": net}
    nodes = p.create_nodes(req, net)
    assert [(n.rank, n.instance_id, n.host) for n in nodes] == [
        (0, "gcp-0", "10.0.0.1"), (1, "gcp-1", "10.0.0.2")]
    assert p.create_nodes(req, net) == nodes            # adopted, not made twice
    assert p.list_nodes("c") == nodes and p.list_nodes("other") == []
    p.terminate("c")
    p.terminate("c")                                   # twice is fine
    assert p.list_nodes("c") == [] and p.networks == {} and p.terminated == ["c", "c"]
    assert p.calls == ["network", "network", "create m1 r1", "create m1 r1", "terminate",
                       "terminate"]


def test_a_failure_can_leave_a_half_built_cluster() -> None:
    p = MemoryProvider(fail_with=CapacityError("no capacity in zone a"), partial=1)
    req = _request(n=3)
    with pytest.raises(CapacityError, match="zone a"):
        p.create_nodes(req, NetworkRef("n"))
    assert [n.rank for n in p.list_nodes("c")] == [0]   # what was made before the failure
    p.fail_with = None
    assert [n.rank for n in p.create_nodes(req, NetworkRef("n"))] == [0, 1, 2]


def test_handed_in_through_the_env_it_wins_over_the_installed_provider(tmp_path: Path) -> None:
    fake = MemoryProvider.named("aws")
    env = _env(tmp_path, aws=fake)
    assert env.provider("aws") is fake and env.provider_class("aws") is type(fake)
    assert env.sdk_missing("aws") is None and env.has_credentials("aws")
    assert "aws" in env.provider_names()
    # nothing global: another Env, and the registry, know nothing of it
    assert not isinstance(_env(tmp_path).provider("local"), MemoryProvider)
    assert registry.provider_class("aws") is not type(fake)
    # a name no entry point has is still served when handed in
    odd = MemoryProvider.named("mycloud")
    assert _env(tmp_path, mycloud=odd).provider("mycloud") is odd


def test_provision_through_the_env_rolls_a_failed_cluster_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.pipeline.provision import provision

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    fake = MemoryProvider.named("local", fail_with=QuotaError("quota: 0 vCPUs left"), partial=1)
    env = open_env(UI(quiet=True), {"local": fake})
    with pytest.raises(QuotaError):
        provision(env, parse_task("name: q\nnum_nodes: 2\nrun: 'true'\n"), "q")
    assert fake.terminated == ["q"] and fake.nodes == {} and fake.networks == {}
    assert env.state.get_cluster("q") is None


def test_the_command_line_takes_it_as_its_context_object(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    fake = MemoryProvider.named("local", fail_with=CapacityError("no capacity anywhere"))
    task = tmp_path / "t.yaml"
    task.write_text("name: att\nnum_nodes: 2\nrun: 'true'\n")
    r = CliRunner().invoke(cli, ["up", str(task), "-y", "--json"], obj={"local": fake})
    assert r.exit_code != 0
    doc = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    assert doc["ok"] is False and "no capacity anywhere" in doc["error"]
    assert fake.calls[-2:] == ["create None None", "terminate"]
    # gc asks the class it was handed (one that cannot list orphans), not whether it is a fake
    gc = CliRunner().invoke(cli, ["gc", "--provider", "aws"],
                            obj={"aws": MemoryProvider.named("aws")})
    assert gc.exit_code == 2 and "cannot list what it created" in gc.output
