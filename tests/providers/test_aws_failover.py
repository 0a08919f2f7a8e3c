"""AWS failover with errors injected at the API boundary (botocore's before-call event; moto
runs everything else): which zones and regions are tried in which order, the reason kept for
each, partial launches rolled back, credentials errors stopping at once, throttling retried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from cloudtrain.catalog.model import Offer  # noqa: E402
from cloudtrain.context import open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.errors import (AuthError, CapacityError, ProviderError, QuotaError,  # noqa: E402
                               TransientError)
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from cloudtrain_provisioners.aws import tags as T  # noqa: E402
from aws_moto import Harness, add_images_to_moto, hermetic_env  # noqa: E402

REGIONS = ("us-east-1", "us-west-2", "eu-west-1")
PRICES = {"us-east-1": 21.96, "us-west-2": 22.5, "eu-west-1": 23.72}
OFFERS = [Offer("aws", "p4d.24xlarge", "A100", 8, 40, 96, 1152, r, price=p, spot_price=p / 3)
          for r, p in PRICES.items()]
CAPACITY = "InsufficientInstanceCapacity"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from moto import mock_aws

    hermetic_env(monkeypatch)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with mock_aws():
        for r in REGIONS:
            add_images_to_moto(r)
        yield Harness(tmp_path / "home", regions=REGIONS)


def _provider(h: Harness):  # type: ignore[no-untyped-def]
    return h.provider(offers=lambda: OFFERS)


def _req(h: Harness, **kw):  # type: ignore[no-untyped-def]
    """A request that names no region: the provider picks them in price order."""
    return h.request(region=None, offers=lambda: OFFERS, **kw)


def _up(h: Harness, req, p=None):  # type: ignore[no-untyped-def]
    p = p or _provider(h)
    return p, p.create_nodes(req, p.ensure_network(req))


def _where(h: Harness, region: str) -> set[str]:
    return {i["Placement"]["AvailabilityZone"] for i in h.tagged(region)["instances"]}


def _tried(p, name: str = "demo") -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    return [(a["zone"] or a["region"], a["outcome"], a["code"]) for a in p.attempts(name)]


def _run_zones(h: Harness) -> list[str]:
    return [c["Placement"]["AvailabilityZone"] for c in h.faults.ops("RunInstances")]


def test_capacity_moves_to_the_next_zone_and_keeps_each_reason(aws: Harness) -> None:
    aws.faults.fail("RunInstances", CAPACITY, zone="us-east-1a")
    aws.faults.fail("RunInstances", "Unsupported", zone="us-east-1b")
    p, nodes = _up(aws, _req(aws))
    assert _where(aws, "us-east-1") == {"us-east-1c"}
    assert _tried(p) == [("us-east-1a", "capacity", CAPACITY),
                         ("us-east-1b", "capacity", "Unsupported"),
                         ("us-east-1c", "ok", "launched")]
    assert [n.rank for n in nodes] == [0, 1]
    # shown as it happens, and kept with the cluster
    assert "us-east-1a" in aws.messages() and CAPACITY in aws.messages()
    saved = json.loads((aws.home / "clusters" / "demo" / "aws.json").read_text())
    assert [(a["zone"], a["outcome"]) for a in saved["attempts"]] == [
        ("us-east-1a", "capacity"), ("us-east-1b", "capacity"), ("us-east-1c", "ok")]
    assert saved["zone"] == "us-east-1c" and saved["region"] == "us-east-1"


def test_zones_in_turn_then_regions_in_price_order(aws: Harness) -> None:
    aws.faults.fail("RunInstances", CAPACITY, region="us-east-1")
    aws.faults.fail("RunInstances", "InsufficientHostCapacity", zone="us-west-2a")
    p, nodes = _up(aws, _req(aws))
    assert _tried(p) == [("us-east-1a", "capacity", CAPACITY), ("us-east-1b", "capacity", CAPACITY),
                         ("us-east-1c", "capacity", CAPACITY), ("us-east-1d", "capacity", CAPACITY),
                         ("us-west-2a", "capacity", "InsufficientHostCapacity"),
                         ("us-west-2b", "ok", "launched")]
    assert _where(aws, "us-west-2") == {"us-west-2b"}
    assert aws.counts("us-east-1")["instances"] == 0
    # a cluster's nodes were always asked for in one zone at a time
    zones = _run_zones(aws)
    assert zones == sorted(zones, key=lambda z: (list(PRICES).index(z[:-1]), z))


def test_quota_moves_to_the_next_region_at_once(aws: Harness) -> None:
    aws.faults.fail("RunInstances", "VcpuLimitExceeded", region="us-east-1")
    p, nodes = _up(aws, _req(aws))
    assert _tried(p) == [("us-east-1a", "quota", "VcpuLimitExceeded"),
                         ("us-west-2a", "ok", "launched")]
    assert {z[:-1] for z in _run_zones(aws)} == {"us-east-1", "us-west-2"}
    assert _where(aws, "us-west-2") == {"us-west-2a"}


def test_spot_capacity_and_spot_quota(aws: Harness) -> None:
    aws.faults.fail("RunInstances", "SpotMaxPriceTooLow", zone="us-east-1a")
    aws.faults.fail("RunInstances", "MaxSpotInstanceCountExceeded", zone="us-east-1b")
    p, nodes = _up(aws, _req(aws, use_spot=True))
    assert _tried(p) == [("us-east-1a", "capacity", "SpotMaxPriceTooLow"),
                         ("us-east-1b", "quota", "MaxSpotInstanceCountExceeded"),
                         ("us-west-2a", "ok", "launched")]
    assert all(n.spot for n in nodes)


def test_partial_launch_is_rolled_back_before_moving_on(aws: Harness) -> None:
    def rank1(params: dict) -> bool:  # type: ignore[type-arg]
        tags = {s["ResourceType"]: T.as_dict(s["Tags"]) for s in params["TagSpecifications"]}
        return tags["instance"][T.RANK] == "1"

    aws.faults.fail("RunInstances", CAPACITY, zone="us-east-1a", when=rank1)
    p, nodes = _up(aws, _req(aws))
    raw = aws.clients.raw("us-east-1")
    every = [i for r in raw.describe_instances()["Reservations"] for i in r["Instances"]]
    in_a = [i for i in every if i["Placement"]["AvailabilityZone"] == "us-east-1a"]
    assert len(in_a) == 1 and in_a[0]["State"]["Name"] == "terminated"   # rank 0 got, then given back
    assert _where(aws, "us-east-1") == {"us-east-1b"}
    assert {n.instance_id for n in nodes} == {i["InstanceId"] for i in aws.tagged()["instances"]}
    ops = [o for _, o, _ in aws.faults.calls]
    # terminated before the next zone was tried
    term = ops.index("TerminateInstances")
    assert [z for z in _run_zones(aws)][:2] == ["us-east-1a", "us-east-1a"]
    assert ops[term + 1:].count("RunInstances") == 2
    assert "terminating the 1 node(s) this attempt got" in aws.messages()


def test_node_ending_while_starting_is_capacity(aws: Harness) -> None:
    """AWS accepts the launch, then takes the instance back before it runs."""
    raw = aws.clients.raw("us-east-1")
    taken: list[str] = []

    def take_back(params: dict) -> bool:  # type: ignore[type-arg]
        ids = [v for f in params.get("Filters", []) if f["Name"] == "instance-id"
               for v in f["Values"]]
        if ids and not taken:
            taken.append(ids[0])
            aws.faults.interrupted[ids[0]] = "Server.InsufficientInstanceCapacity"
            raw.terminate_instances(InstanceIds=[ids[0]])
        return False

    aws.faults.fail("DescribeInstances", "never", when=take_back)
    p, nodes = _up(aws, _req(aws))
    assert _tried(p) == [("us-east-1a", "capacity", "Server.InsufficientInstanceCapacity"),
                         ("us-east-1b", "ok", "launched")]
    assert _where(aws, "us-east-1") == {"us-east-1b"}


def test_nothing_in_any_zone_gives_up_with_every_attempt_and_leaves_nothing(aws: Harness) -> None:
    """Through the core: the region is given, every zone is out of capacity."""
    aws.faults.fail("RunInstances", CAPACITY)
    env = open_env(UI(quiet=True), {"aws": _provider(aws)})
    task = parse_task("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: aws\n"
                      "  region: us-east-1\n  accelerators: A100:8\n"
                      "  aws: {host_key_wait: 0}\n")
    with pytest.raises(CapacityError) as e:
        provision(env, task, "demo")
    msg = e.value.message
    assert "after 4 attempt(s)" in msg
    for zone in ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d"):
        assert f"{zone}: {CAPACITY}" in msg
    assert "another region" in e.value.hint
    assert aws.counts("us-east-1") == {"instances": 0, "security_groups": 0, "key_pairs": 0,
                                       "placement_groups": 0, "volumes": 0}
    assert env.state.get_cluster("demo") is None


def test_nothing_in_any_region_names_every_attempt(aws: Harness) -> None:
    """The provider on its own, no region: every zone of every region in price order."""
    aws.faults.fail("RunInstances", CAPACITY)
    with pytest.raises(CapacityError) as e:
        _up(aws, _req(aws))
    for zone in ("us-east-1a", "us-east-1d", "us-west-2a", "eu-west-1c"):
        assert f"{zone}: {CAPACITY}" in e.value.message
    for r in REGIONS:
        assert aws.counts(r)["instances"] == 0, r


def test_quota_everywhere_is_a_quota_error(aws: Harness) -> None:
    aws.faults.fail("RunInstances", "VcpuLimitExceeded")
    with pytest.raises(QuotaError, match="3 attempt"):
        _up(aws, _req(aws))


@pytest.mark.parametrize("code", ["UnauthorizedOperation", "AuthFailure", "ExpiredToken"])
def test_credentials_problem_stops_at_once(aws: Harness, code: str) -> None:
    aws.faults.fail("RunInstances", code, zone="us-east-1a")
    with pytest.raises(AuthError) as e:
        _up(aws, _req(aws))
    assert code in e.value.message
    assert "credentials" in e.value.hint and "docs/aws.md" in e.value.hint
    assert set(_run_zones(aws)) == {"us-east-1a"}             # no other zone, no other region
    assert aws.counts()["instances"] == 0
    assert aws.sleeps == []                                   # and no retrying


def test_missing_credentials_stop_before_anything(aws: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    from aws_moto import EmulatorClients

    h = Harness(aws.home, clients=EmulatorClients())
    with pytest.raises(AuthError) as e:
        _up(h, _req(h))
    assert "aws configure" in e.value.hint


def test_throttling_is_retried_with_backoff_in_place(aws: Harness) -> None:
    aws.faults.fail("RunInstances", "RequestLimitExceeded", times=2)
    p, nodes = _up(aws, _req(aws, num_nodes=1))
    assert _tried(p) == [("us-east-1a", "ok", "launched")]
    assert len(p.api.delays) == 2 and p.api.delays[0] <= p.api.delays[1]
    assert aws.sleeps[:2] == p.api.delays


def test_throttling_that_does_not_stop_is_reported_not_failed_over(aws: Harness) -> None:
    aws.faults.fail("RunInstances", "RequestLimitExceeded")
    with pytest.raises(TransientError, match="RequestLimitExceeded"):
        _up(aws, _req(aws, num_nodes=1))
    assert set(_run_zones(aws)) == {"us-east-1a"}
    assert len(aws.faults.ops("RunInstances")) == 6


def test_given_zone_is_the_only_one_tried(aws: Harness) -> None:
    aws.faults.fail("RunInstances", CAPACITY, zone="us-east-1b")
    with pytest.raises(CapacityError, match="us-east-1b"):
        _up(aws, aws.request(region="us-east-1", zone="us-east-1b", offers=lambda: OFFERS))
    assert set(_run_zones(aws)) == {"us-east-1b"}


def test_partial_launch_that_cannot_be_rolled_back_stops_instead_of_moving_on(aws: Harness) -> None:
    aws.faults.fail("RunInstances", CAPACITY, zone="us-east-1a", skip=1)
    aws.faults.fail("TerminateInstances", "InternalError")
    with pytest.raises(ProviderError, match="could not be terminated") as e:
        _up(aws, _req(aws))
    assert not isinstance(e.value, (CapacityError, QuotaError))
    assert set(_run_zones(aws)) == {"us-east-1a"}
    aws.faults.clear()
    aws.provider().terminate("demo")
    assert aws.counts()["instances"] == 0
