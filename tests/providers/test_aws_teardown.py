"""AWS teardown against moto: after ``down`` (with and without local state, twice, and after a
failure injected at each step of ``up``) the emulator holds nothing with cloudtrain's tags;
``gc`` finds and removes what no live cluster owns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from click.testing import CliRunner  # noqa: E402

from cloudtrain.context import Env, open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.pipeline.teardown import down  # noqa: E402
from cloudtrain.errors import ProviderError  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from aws_moto import Harness, add_images_to_moto, hermetic_env  # noqa: E402

REGION = "us-east-1"
EMPTY = {"instances": 0, "security_groups": 0, "key_pairs": 0, "placement_groups": 0,
         "volumes": 0}
TASK = """
name: {name}
num_nodes: {n}
run: echo hi
resources:
  provider: aws
  region: us-east-1
  accelerators: A100:8
  aws: {{host_key_wait: 0}}
"""


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from moto import mock_aws

    hermetic_env(monkeypatch)
    home = tmp_path / "home"
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(home))
    with mock_aws():
        add_images_to_moto(REGION)
        yield Harness(home)


def _task(name: str = "demo", n: int = 2):  # type: ignore[no-untyped-def]
    return parse_task(TASK.format(name=name, n=n))


def _env(h: Harness) -> Env:
    """This home's Env, the emulator's provider handed in."""
    return open_env(UI(quiet=True), {"aws": h.provider()})


def _fresh(h: Harness, env: Env) -> None:
    """A new process: a new provider instance (nothing cached in memory)."""
    env.providers = {"aws": h.provider()}


def test_down_terminates_waits_then_deletes_network_keys_and_placement_group(aws: Harness) -> None:
    env = _env(aws)
    provision(env, _task(), "demo")
    assert aws.counts() == {**EMPTY, "instances": 2, "security_groups": 1, "key_pairs": 1,
                            "placement_groups": 1, "volumes": 2}
    _fresh(aws, env)
    aws.faults.calls.clear()
    down(env, "demo")
    assert aws.counts() == EMPTY
    assert env.state.get_cluster("demo") is None
    ops = [o for _, o, _ in aws.faults.calls]
    # instances first, confirmed terminated, then what they used
    t = ops.index("TerminateInstances")
    sg = ops.index("DeleteSecurityGroup")
    assert t < sg and "DescribeInstances" in ops[t:sg]
    assert ops.index("DeleteKeyPair") > t and ops.index("DeletePlacementGroup") > t
    # every instance in one call
    (term,) = aws.faults.ops("TerminateInstances")
    assert len(term["InstanceIds"]) == 2


def test_security_group_deletion_is_retried_while_interfaces_detach(aws: Harness) -> None:
    env = _env(aws)
    provision(env, _task(), "demo")
    aws.faults.fail("DeleteSecurityGroup", "DependencyViolation", times=3)
    _fresh(aws, env)
    down(env, "demo")
    assert aws.counts() == EMPTY
    assert len(aws.faults.ops("DeleteSecurityGroup")) == 4
    assert aws.sleeps[:3] == sorted(aws.sleeps[:3]) and aws.sleeps[0] > 0   # backing off


def test_down_with_no_local_state_finds_everything_by_tag(aws: Harness) -> None:
    env = _env(aws)
    provision(env, _task(), "demo")
    # the state row and the cluster's folder (keys, aws.json) are gone
    env.state.delete_cluster("demo")
    shutil.rmtree(aws.home / "clusters" / "demo")
    _fresh(aws, env)
    down(env, "demo", provider_name="aws")
    assert aws.counts() == EMPTY
    # with no hint of where it ran, every enabled region was searched
    assert aws.faults.ops("DescribeRegions")


def test_down_twice_in_a_row(aws: Harness) -> None:
    env = _env(aws)
    provision(env, _task(), "demo")
    p = aws.provider()
    p.terminate("demo")
    p.terminate("demo")
    assert aws.counts() == EMPTY
    _fresh(aws, env)
    down(env, "demo")                          # the state row still names it
    down(env, "demo", provider_name="aws")     # and once more, by tag only
    assert aws.counts() == EMPTY


def _waiting(params: dict) -> bool:  # type: ignore[type-arg]
    """The DescribeInstances that waits for the new instances (by id, not by tag)."""
    return any(f["Name"] == "instance-id" for f in params.get("Filters", []))


STEPS = [
    ("DescribeVpcs", 0, None),
    ("CreateSecurityGroup", 0, None),
    ("AuthorizeSecurityGroupIngress", 0, None),
    ("ImportKeyPair", 0, None),
    ("DescribeInstanceTypes", 0, None),
    ("DescribeImages", 0, None),
    ("CreatePlacementGroup", 0, None),
    ("RunInstances", 0, None),        # the first node
    ("RunInstances", 1, None),        # the second: the first was launched
    ("DescribeInstances", 0, _waiting),
]


@pytest.mark.parametrize("op,skip,when", STEPS, ids=[f"{o}-{s}" for o, s, _ in STEPS])
def test_a_failure_at_any_step_of_up_leaves_nothing(aws: Harness, op: str, skip: int,
                                                    when) -> None:  # type: ignore[no-untyped-def]
    env = _env(aws)
    aws.faults.fail(op, "InvalidParameterValue", skip=skip, times=1, when=when)
    with pytest.raises(ProviderError, match="InvalidParameterValue"):
        provision(env, _task(), "demo")
    assert aws.faults.injected, "the failure was injected"
    assert aws.counts() == EMPTY
    assert env.state.get_cluster("demo") is None
    assert not (aws.home / "clusters" / "demo").exists()


def test_interrupted_up_is_rolled_back(aws: Harness) -> None:
    """Ctrl-C while the second node is being launched."""
    env = _env(aws)
    calls = []

    def interrupt(params: dict) -> bool:  # type: ignore[type-arg]
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return False

    aws.faults.fail("RunInstances", "never", when=interrupt)
    with pytest.raises(KeyboardInterrupt):
        provision(env, _task(), "demo")
    assert aws.counts() == EMPTY


def test_kept_half_built_cluster_is_removed_by_down(aws: Harness) -> None:
    env = _env(aws)
    aws.faults.fail("RunInstances", "InvalidParameterValue", skip=1)
    with pytest.raises(ProviderError):
        provision(env, _task(), "demo", keep_on_failure=True)
    held = aws.counts()
    assert held["security_groups"] == 1 and held["key_pairs"] == 1
    aws.faults.clear()
    _fresh(aws, env)
    down(env, "demo")
    assert aws.counts() == EMPTY


def test_teardown_that_cannot_finish_keeps_the_state_row(aws: Harness) -> None:
    env = _env(aws)
    provision(env, _task(), "demo")
    aws.faults.fail("DeleteKeyPair", "InvalidParameterValue")
    _fresh(aws, env)
    with pytest.raises(ProviderError, match="teardown did not finish"):
        down(env, "demo")
    assert env.state.get_cluster("demo") is not None      # nothing forgotten locally
    aws.faults.clear()
    down(env, "demo")
    assert aws.counts() == EMPTY and env.state.get_cluster("demo") is None


# --- gc -------------------------------------------------------------------------------------

def _cli():  # type: ignore[no-untyped-def]
    import click

    from cloudtrain.commands.main import cli
    from cloudtrain.commands import gc as cmd_gc

    if "gc" not in cli.commands:
        group = click.Group(name="cloudtrain", commands=dict(cli.commands))
        cmd_gc.register(group)
        return group
    return cli


def test_gc_lists_and_removes_only_what_no_live_cluster_owns(aws: Harness) -> None:
    env = _env(aws)
    provision(env, _task("live"), "live")
    provision(env, _task("orphan", 1), "orphan")
    env.state.delete_cluster("orphan")              # e.g. its state was lost
    # someone else's cluster in the same account
    other = aws.provider(owner="bob@elsewhere")
    req = aws.request(name="bobs", num_nodes=1)
    other.create_nodes(req, other.ensure_network(req))
    _fresh(aws, env)

    runner = CliRunner()
    r = runner.invoke(_cli(), ["gc", "--provider", "aws", "--json"], obj=env.providers)
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout)
    assert {x["cluster"] for x in listed} == {"orphan"}
    assert {x["kind"] for x in listed} == {"instance", "security-group", "key-pair"}
    assert not any(x["removed"] for x in listed)
    assert aws.counts(cluster="orphan")["instances"] == 1      # listing removes nothing

    r = runner.invoke(_cli(), ["gc", "--provider", "aws", "--force", "-y", "--json"],
                      obj=env.providers)
    assert r.exit_code == 0, r.output
    assert all(x["removed"] for x in json.loads(r.stdout))
    assert aws.counts(cluster="orphan") == EMPTY
    assert aws.counts(cluster="live")["instances"] == 2
    assert aws.counts(cluster="bobs")["instances"] == 1

    r = runner.invoke(_cli(), ["gc", "--provider", "aws", "--any-owner", "--json"],
                      obj=env.providers)
    assert {x["cluster"] for x in json.loads(r.stdout)} == {"bobs"}
    r = runner.invoke(_cli(), ["gc", "--provider", "aws"], obj=env.providers)
    assert "nothing to collect" in r.output


def test_gc_all_regions(aws: Harness) -> None:
    add_images_to_moto("eu-west-1")
    p = aws.provider()
    req = aws.request(name="far", num_nodes=1, region="eu-west-1")
    p.create_nodes(req, p.ensure_network(req))
    shutil.rmtree(aws.home / "clusters" / "far")        # no hint of eu-west-1 left locally
    assert p.orphans(set()) == []                         # not in the default region
    found = p.orphans(set(), all_regions=True)
    assert {(r.region, r.kind) for r in found} == {("eu-west-1", "instance"),
                                                   ("eu-west-1", "security-group"),
                                                   ("eu-west-1", "key-pair")}
    p.remove(found)
    assert aws.counts("eu-west-1") == EMPTY
