"""Azure teardown against the ARM fake: after ``down`` (with and without local state, twice,
on a half-built cluster, after a failure injected at each step of ``up``) the fake holds
nothing with cloudtrain's tags; ``gc`` finds and removes what no live cluster owns;
``up --dry-run`` shows the plan and creates nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("azure.mgmt.compute")

from arm_fake import ArmFake, Harness, hermetic_env  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from cloudtrain.context import Env, open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.pipeline.teardown import down  # noqa: E402
from cloudtrain.errors import ProviderError  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402

TASK = """
name: {name}
num_nodes: {n}
run: echo hi
resources:
  provider: azure
  region: eastus
  accelerators: A100:8
"""


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    home = tmp_path / "home"
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(home))
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, home)
    finally:
        fake.stop()


def _task(name: str = "demo", n: int = 2):  # type: ignore[no-untyped-def]
    return parse_task(TASK.format(name=name, n=n))


def _env(az: Harness) -> Env:
    """This home's Env, the fake's provider handed in."""
    return open_env(UI(quiet=True), {"azure": az.provider()})


def _fresh(az: Harness, env: Env, **kw: Any) -> None:
    """A new process: a new provider instance (nothing cached in memory)."""
    env.providers = {"azure": az.provider(**kw)}


FULL = {"resourceGroups": 1, "networkSecurityGroups": 1, "virtualNetworks": 1,
        "publicIPAddresses": 2, "networkInterfaces": 2, "virtualMachines": 2, "disks": 2,
        # 2 x A100:8 is an InfiniBand size: one availability set in a placement group
        "availabilitySets": 1, "proximityPlacementGroups": 1}


def test_down_deletes_the_group_then_checks_each_resource_is_gone(az: Harness) -> None:
    env = _env(az)
    provision(env, _task(), "demo")
    assert az.fake.counts() == FULL
    _fresh(az, env)
    n = len(az.fake.requests)
    down(env, "demo")
    assert az.fake.everything() == [] and az.fake.tagged() == []
    assert env.state.get_cluster("demo") is None
    assert not (az.home / "clusters" / "demo").exists()
    after = [(r.method, r.kind) for r in az.fake.requests[n:]]
    d = after.index(("DELETE", "resourcegroups"))
    assert after.count(("DELETE", "resourcegroups")) == 1          # one call removes it all
    assert ("GET", "resources") in after[:d]                        # what it held, listed first
    checked = after[d + 1:]
    assert ("HEAD", "resourcegroups") in checked
    for kind, count in (("virtualmachines", 2), ("disks", 2), ("networkinterfaces", 2),
                        ("publicipaddresses", 2), ("networksecuritygroups", 1),
                        ("virtualnetworks", 1)):
        got = [r for r in az.fake.requests[n:][d + 1:] if r.method == "GET" and r.kind == kind
               and r.name]
        assert len(got) >= count, kind
    (delete,) = az.fake.ops_of("DELETE", "resourcegroups")
    assert delete.query.get("forceDeletionTypes") == "Microsoft.Compute/virtualMachines"


def test_down_with_no_local_state_finds_everything_by_tag(az: Harness) -> None:
    env = _env(az)
    provision(env, _task(), "demo")
    # the state row and the cluster's folder (keys, azure.json) are gone
    env.state.delete_cluster("demo")
    shutil.rmtree(az.home / "clusters" / "demo")
    _fresh(az, env)
    down(env, "demo", provider_name="azure")
    assert az.fake.everything() == []
    listed = [r for r in az.fake.ops_of("GET", "resourcegroups") if not r.name]
    assert listed and listed[0].query["$filter"] == "tagName eq 'cloudtrain:cluster' and " \
                                                   "tagValue eq 'demo'"


def test_down_finds_the_group_by_tag_whatever_its_name(az: Harness) -> None:
    """The tags are the truth: a group of the cluster under another name is found too."""
    env = _env(az)
    provision(env, _task(n=1), "demo")
    p = az.provider()
    with az.fake.lock:   # e.g. made by an older cloudtrain that named groups differently
        g = dict(az.fake.groups[p.group("demo").lower()])
        az.fake.groups["old-name"] = {**g, "name": "old-name",
                                      "id": g["id"].rsplit("/", 1)[0] + "/old-name"}
    _fresh(az, env)
    down(env, "demo")
    assert az.fake.everything() == []


def test_down_twice_in_a_row(az: Harness) -> None:
    env = _env(az)
    provision(env, _task(), "demo")
    p = az.provider()
    p.terminate("demo")
    p.terminate("demo")
    assert az.fake.everything() == []
    _fresh(az, env)
    down(env, "demo")                            # the state row still names it
    down(env, "demo", provider_name="azure")     # and once more, by tag only
    assert az.fake.everything() == []


def test_another_owners_cluster_of_the_same_name_is_left_alone(az: Harness) -> None:
    env = _env(az)
    provision(env, _task(n=1), "demo")
    bob = az.provider(owner="bob@elsewhere")
    az.up(az.request(num_nodes=1), bob)
    _fresh(az, env)
    down(env, "demo")
    left = az.fake.tagged("demo")
    assert left and {r["tags"]["cloudtrain:owner"] for r in left} == {"bob@elsewhere"}
    assert len(bob.list_nodes("demo")) == 1


STEPS = [
    ("PUT", "resourcegroups", 0, "sync"),
    ("PUT", "networksecuritygroups", 0, "async"),
    ("PUT", "virtualnetworks", 0, "sync"),
    ("GET", "skus", 0, "sync"),
    ("GET", "versions", 0, "sync"),
    ("PUT", "publicipaddresses", 0, "async"),
    ("PUT", "publicipaddresses", 1, "sync"),
    ("PUT", "networkinterfaces", 0, "sync"),
    ("PUT", "networkinterfaces", 1, "async"),
    ("PUT", "virtualmachines", 0, "sync"),       # the first node
    ("PUT", "virtualmachines", 1, "async"),      # the second: the first was made
    ("PATCH", "disks", 1, "sync"),               # tagging an OS disk
    ("GET", "virtualmachines", 1, "sync"),       # create_nodes' look at what exists
    ("GET", "virtualmachines", 2, "sync"),       # the wait for the new VMs to run
    ("GET", "networkinterfaces", 0, "sync"),     # reading the nodes' addresses
]


@pytest.mark.parametrize("method,kind,skip,mode", STEPS,
                         ids=[f"{m}-{k}-{s}-{mo}" for m, k, s, mo in STEPS])
def test_a_failure_at_any_step_of_up_leaves_nothing(az: Harness, method: str, kind: str,
                                                    skip: int, mode: str) -> None:
    env = _env(az)
    fault = az.fake.fail(method, kind, "InvalidParameter", f"injected at {method} {kind}",
                         status=400, mode=mode, skip=skip,
                         when=lambda r: not (r.method == "GET" and r.kind == "virtualmachines"
                                             and r.name))
    with pytest.raises(ProviderError, match="InvalidParameter"):
        provision(env, _task(), "demo")
    assert fault.fired == 1, "the failure was injected"
    assert az.fake.tagged() == [] and az.fake.everything() == []
    assert env.state.get_cluster("demo") is None
    assert not (az.home / "clusters" / "demo").exists()


def test_interrupted_up_is_rolled_back(az: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the second node is being created."""
    from cloudtrain_provisioners.azure import instances

    real = instances.vm_body

    def interrupt(spec, rank, *a, **kw):  # type: ignore[no-untyped-def]
        if rank == 1:
            raise KeyboardInterrupt
        return real(spec, rank, *a, **kw)

    monkeypatch.setattr(instances, "vm_body", interrupt)
    env = _env(az)
    with pytest.raises(KeyboardInterrupt):
        provision(env, _task(), "demo")
    assert az.fake.everything() == []
    assert env.state.get_cluster("demo") is None


def test_kept_half_built_cluster_is_removed_by_down(az: Harness) -> None:
    env = _env(az)
    az.fake.fail("PUT", "virtualmachines", "InvalidParameter", status=400, skip=1)
    with pytest.raises(ProviderError):
        provision(env, _task(), "demo", keep_on_failure=True)
    held = az.fake.counts()
    assert held["resourceGroups"] == 1 and held["networkSecurityGroups"] == 1
    assert held.get("virtualMachines", 0) == 0    # the attempt's own VMs were given back
    az.fake.clear_faults()
    _fresh(az, env)
    down(env, "demo")
    assert az.fake.everything() == []


def test_teardown_that_cannot_finish_keeps_the_state_row(az: Harness) -> None:
    env = _env(az)
    provision(env, _task(), "demo")
    az.fake.fail("DELETE", "resourcegroups", "ScopeLocked", "The scope is locked.",
                 mode="async")
    _fresh(az, env)
    with pytest.raises(ProviderError, match="ScopeLocked"):
        down(env, "demo")
    assert env.state.get_cluster("demo") is not None      # nothing forgotten locally
    assert az.fake.counts() == FULL
    down(env, "demo")
    assert az.fake.everything() == [] and env.state.get_cluster("demo") is None


def test_a_resource_that_outlives_its_group_is_reported(az: Harness) -> None:
    env = _env(az)
    provision(env, _task(n=1), "demo")
    (disk,) = az.fake.of_type("disks")
    az.fake.sticky.add(disk["id"].lower())
    _fresh(az, env)
    with pytest.raises(ProviderError, match="still lists.*disk demo-0-osdisk"):
        down(env, "demo")
    assert env.state.get_cluster("demo") is not None
    assert len(az.sleeps) == 3                      # it waited for ARM to catch up first
    az.fake.sticky.clear()
    with az.fake.lock:
        az.fake.resources.pop(disk["id"].lower())
    down(env, "demo")
    assert az.fake.everything() == []


def test_launch_down_path_with_nothing_created_is_quiet(az: Harness) -> None:
    """``down --provider azure`` of a cluster that never existed finds nothing, calls no
    delete."""
    env = _env(az)
    down(env, "never", provider_name="azure")
    assert az.fake.ops_of("DELETE", "resourcegroups") == []


# --- gc --------------------------------------------------------------------------------------------

def test_gc_lists_and_removes_only_what_no_live_cluster_owns(az: Harness) -> None:
    env = _env(az)
    provision(env, _task("live", 1), "live")
    provision(env, _task("orphan", 1), "orphan")
    env.state.delete_cluster("orphan")              # e.g. its state was lost
    bob = az.provider(owner="bob@elsewhere")        # someone else's, same subscription
    az.up(az.request(name="bobs", num_nodes=1), bob)
    p = az.provider()
    live = {c.name for c in env.state.list_clusters() if c.provider == "azure"}
    found = p.orphans(live)
    assert {r.cluster for r in found} == {"orphan"}
    assert found[0].kind == "resource-group"        # each group, then what it holds
    assert {r.kind for r in found} == {"resource-group", "virtual-machine", "disk",
                                       "network-interface", "network-security-group",
                                       "public-ip", "virtual-network"}
    assert "cluster orphan" in found[0].text() and found[0].region == "eastus"
    assert az.fake.tagged("orphan")                 # listing removes nothing
    p.remove(found)
    assert az.fake.tagged("orphan") == []
    assert az.fake.tagged("live") and az.fake.tagged("bobs")
    assert {r.cluster for r in p.orphans(live, any_owner=True)} == {"bobs"}
    assert p.orphans(live) == []


def test_gc_through_the_cli(az: Harness) -> None:
    """The generic ``cloudtrain gc`` command (registered by the AWS package for now) drives
    the Azure provider's orphans/remove."""
    cmd_gc = pytest.importorskip("cloudtrain.commands.gc")
    import click

    from cloudtrain.commands.main import cli

    group = cli
    if "gc" not in cli.commands:
        group = click.Group(name="cloudtrain", commands=dict(cli.commands))
        cmd_gc.register(group)
    env = _env(az)
    provision(env, _task("orphan", 1), "orphan")
    env.state.delete_cluster("orphan")
    _fresh(az, env)
    runner = CliRunner()
    r = runner.invoke(group, ["gc", "--provider", "azure", "--json"], obj=env.providers)
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout)
    assert {x["cluster"] for x in listed} == {"orphan"} and not any(x["removed"] for x in listed)
    r = runner.invoke(group, ["gc", "--provider", "azure", "--force", "-y", "--json"],
                      obj=env.providers)
    assert r.exit_code == 0, r.output
    assert all(x["removed"] for x in json.loads(r.stdout))
    assert az.fake.everything() == []


# --- dry run -----------------------------------------------------------------------------------------

def test_up_dry_run_shows_the_plan_and_creates_nothing(az: Harness, tmp_path: Path) -> None:
    from cloudtrain.commands.main import cli

    task = tmp_path / "task.yaml"
    task.write_text(TASK.format(name="demo", n=2).replace(
        "  accelerators: A100:8\n", "  accelerators: A100:8\n  ports: [8888]\n"
                                    "  ssh_cidr: 198.51.100.0/24\n  use_spot: true\n"))
    r = CliRunner().invoke(cli, ["up", str(task), "--dry-run"], obj={"azure": az.provider()})
    assert r.exit_code == 0, r.output
    out = r.output
    assert "dry run: nothing is created" in out
    assert "Standard_ND96asr_v4" in out and "$2.99/h per node, $5.98/h for the cluster" in out
    assert "tcp 22 from 198.51.100.0/24" in out and "tcp 8888 from 198.51.100.0/24" in out
    assert "deny every other inbound flow" in out and "eviction policy Delete" in out
    assert az.fake.calls == [] and az.fake.everything() == []
    assert open_env(UI(quiet=True)).state.get_cluster("demo") is None
