"""GCP failover with errors injected by the Compute Engine REST fake: capacity comes back as a
finished insert operation with an error (next zone), QUOTA_EXCEEDED moves to the next region,
permission errors stop at once with the fix, passing faults are retried; every attempt's
reason is kept; what a multi-node attempt got is deleted before the next zone is tried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.context import open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.errors import AuthError, CapacityError, QuotaError, TransientError  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from cloudtrain_provisioners.gcp import tags as L  # noqa: E402
from gce_fake import Harness, fake_offers  # noqa: E402

EXHAUSTED = "ZONE_RESOURCE_POOL_EXHAUSTED"



def _req(h: Harness, **kw):  # type: ignore[no-untyped-def]
    """A request that names no region: the provider picks them in price order."""
    return h.request(region=None, **kw)


def _tried(p, name: str = "demo") -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    return [(a["zone"] or a["region"], a["outcome"], a["code"]) for a in p.attempts(name)]


def _insert_zones(h: Harness) -> list[str]:
    return [b["_zone"] for b in h.fake.inserted_instances()]


def _zones_of(h: Harness) -> set[str]:
    return {i.split("/")[0] for i in h.fake.ours()["instances"]}


@pytest.mark.parametrize("code", [EXHAUSTED, "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                                  "UNSUPPORTED_OPERATION"])
def test_capacity_moves_to_the_next_zone_and_keeps_the_reason(gcp: Harness, code: str) -> None:
    gcp.fake.fail_operation(code, zone="us-central1-a")
    p, nodes = gcp.up(gcp.request())
    assert _zones_of(gcp) == {"us-central1-b"}
    assert _tried(p) == [("us-central1-a", "capacity", code), ("us-central1-b", "ok", "launched")]
    assert [n.rank for n in nodes] == [0, 1]
    assert f"us-central1-a (n1-standard-8): capacity: {code}" in gcp.messages()
    saved = json.loads((gcp.home / "clusters" / "demo" / "gcp.json").read_text())
    assert [(a["zone"], a["outcome"]) for a in saved["attempts"]] == [
        ("us-central1-a", "capacity"), ("us-central1-b", "ok")]
    assert saved["zone"] == "us-central1-b" and saved["region"] == "us-central1"


def test_zones_in_turn_then_regions_in_price_order(gcp: Harness) -> None:
    gcp.fake.fail_operation(EXHAUSTED, region="us-central1")
    gcp.fake.fail_operation("UNSUPPORTED_OPERATION", zone="us-east1-c")
    p, _ = gcp.up(_req(gcp))
    assert _tried(p) == [("us-central1-a", "capacity", EXHAUSTED),
                         ("us-central1-b", "capacity", EXHAUSTED),
                         ("us-central1-c", "capacity", EXHAUSTED),
                         ("us-east1-c", "capacity", "UNSUPPORTED_OPERATION"),
                         ("us-east1-d", "ok", "launched")]
    assert _zones_of(gcp) == {"us-east1-d"}
    # the nodes of one attempt were always asked for in one zone, zones in the order tried
    zones = _insert_zones(gcp)
    assert list(dict.fromkeys(zones)) == ["us-central1-a", "us-central1-b", "us-central1-c",
                                          "us-east1-c", "us-east1-d"]
    assert all(zones.count(z) == 2 for z in set(zones))


def test_quota_moves_to_the_next_region_at_once(gcp: Harness) -> None:
    gcp.fake.fail_operation("QUOTA_EXCEEDED", region="us-central1")
    p, _ = gcp.up(_req(gcp))
    assert _tried(p) == [("us-central1-a", "quota", "QUOTA_EXCEEDED"),
                         ("us-east1-c", "ok", "launched")]
    assert "NVIDIA_T4_GPUS" in p.attempts("demo")[0]["message"]
    assert _zones_of(gcp) == {"us-east1-c"}


def test_quota_everywhere_is_a_quota_error(gcp: Harness) -> None:
    gcp.fake.fail_operation("QUOTA_EXCEEDED")
    with pytest.raises(QuotaError, match="3 attempt"):
        gcp.up(_req(gcp))
    assert gcp.fake.ours()["instances"] == []


def test_partial_launch_is_rolled_back_before_moving_on(gcp: Harness) -> None:
    gcp.fake.fail_operation(EXHAUSTED, zone="us-central1-a",
                            when=lambda body: body["labels"][L.RANK] == "1")
    p, nodes = gcp.up(gcp.request())
    assert _zones_of(gcp) == {"us-central1-b"}
    reqs = gcp.fake.requests
    deleted = [i for i, r in enumerate(reqs) if r["method"] == "DELETE"
               and "/zones/us-central1-a/instances/" in r["path"]]
    assert len(deleted) == 1 and reqs[deleted[0]]["path"].endswith("-0")  # rank 0: given back
    first_b = next(i for i, r in enumerate(reqs) if r["method"] == "POST"
                   and "/zones/us-central1-b/instances" in r["path"])
    assert deleted[0] < first_b                       # before the next zone was tried
    # ... and its delete was seen through to DONE before moving on
    op_done = [i for i, r in enumerate(reqs[:first_b]) if r["path"].endswith("/wait")
               and "us-central1-a" in r["path"]]
    assert op_done and op_done[-1] > deleted[0]
    assert "deleting the 1 node(s) this attempt got in us-central1-a" in gcp.messages()
    assert {n.instance_id.split("/")[0] for n in nodes} == {
        i.split("/")[1] for i in gcp.fake.ours()["instances"]}


def test_node_taken_back_while_starting_is_capacity(gcp: Harness) -> None:
    gcp.fake.take_back_on_start(zone="us-central1-a", times=1)
    p, _ = gcp.up(gcp.request(use_spot=True))
    assert _tried(p) == [("us-central1-a", "capacity", "INSTANCE_ENDED_WHILE_STARTING"),
                         ("us-central1-b", "ok", "launched")]
    assert _zones_of(gcp) == {"us-central1-b"}
    assert not [z for z in gcp.fake.ours()["disks"] if z.startswith("us-central1-a")]


def test_zone_without_the_machine_or_gpu_is_skipped(gcp: Harness) -> None:
    gcp.fake.unavailable_accelerators.add(("us-central1-a", "nvidia-tesla-t4"))
    gcp.fake.unavailable_machine_types.add(("us-central1-b", "n1-standard-8"))
    p, _ = gcp.up(gcp.request())
    assert [(z, o) for z, o, _ in _tried(p)] == [("us-central1-a", "unavailable"),
                                                 ("us-central1-b", "unavailable"),
                                                 ("us-central1-c", "ok")]
    assert _insert_zones(gcp) == ["us-central1-c"] * 2


def test_nothing_anywhere_gives_up_with_every_attempt_and_leaves_nothing(gcp: Harness) -> None:
    gcp.fake.fail_operation(EXHAUSTED)
    env = open_env(UI(quiet=True), {"gcp": gcp.provider()})
    task = parse_task("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: gcp\n"
                      "  region: us-central1\n  accelerators: T4:1\n")
    with pytest.raises(CapacityError) as e:
        provision(env, task, "demo")
    for zone in ("us-central1-a", "us-central1-b", "us-central1-c"):
        assert f"{zone}: {EXHAUSTED}" in e.value.message
    assert "another region" in e.value.hint
    assert gcp.fake.empty(), gcp.fake.ours()


def test_planner_failover_across_regions_through_up(gcp: Harness,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A task with a cloud but no region: the planner ranks the regions; up fails over
    down that list (rolling back each one) when a region has no capacity or quota."""
    gcp.fake.fail_operation("QUOTA_EXCEEDED", region="us-central1")
    env = open_env(UI(quiet=True), {"gcp": gcp.provider()})
    task = parse_task("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: gcp\n"
                      "  accelerators: T4:1\n")
    monkeypatch.setattr("cloudtrain.planner.catalog_offers", lambda home: fake_offers())
    handle, fresh = provision(env, task, "demo")
    assert fresh and handle.row.region == "us-east1"
    assert _zones_of(gcp) == {"us-east1-c"}


@pytest.mark.parametrize("status,reason", [(403, "forbidden"), (401, "authError")])
def test_permission_problem_stops_at_once_with_the_fix(gcp: Harness, status: int,
                                                       reason: str) -> None:
    gcp.fake.fail_http(status, reason, "Required 'compute.instances.create' permission for "
                                       "'projects/test-project/zones/us-central1-a/instances/x'",
                       method="POST", path="/zones/us-central1-a/instances$")
    with pytest.raises(AuthError) as e:
        gcp.up(_req(gcp))
    if status == 403:
        assert "compute.instances.create" in e.value.message
        assert "roles/compute.instanceAdmin.v1" in e.value.hint and "docs/gcp.md" in e.value.hint
    else:
        assert "gcloud auth application-default login" in e.value.hint
    assert set(_insert_zones(gcp)) == {"us-central1-a"}   # no other zone, no other region
    assert gcp.fake.ours()["instances"] == []
    assert gcp.sleeps == []                                # and no retrying


def test_compute_api_not_enabled_says_how_to_enable_it(gcp: Harness) -> None:
    gcp.fake.fail_http(403, "accessNotConfigured", "Compute Engine API has not been used in "
                                                   "project test-project", method="GET")
    with pytest.raises(AuthError) as e:
        gcp.provider().ensure_network(gcp.request())
    assert "gcloud services enable compute.googleapis.com" in e.value.hint


def test_passing_faults_are_retried_with_backoff_in_place(gcp: Harness) -> None:
    gcp.fake.fail_http(503, "backendError", "try again", method="POST", path="/instances$",
                       times=2)
    p, nodes = gcp.up(gcp.request(num_nodes=1))
    assert _tried(p) == [("us-central1-a", "ok", "launched")]
    assert len(p.api.delays) == 2 and p.api.delays[0] <= p.api.delays[1]
    assert gcp.sleeps[:2] == p.api.delays


def test_faults_that_do_not_pass_are_reported_not_failed_over(gcp: Harness) -> None:
    gcp.fake.fail_http(429, "rateLimitExceeded", "slow down", method="POST", path="/instances$")
    with pytest.raises(TransientError, match="slow down"):
        gcp.up(_req(gcp, num_nodes=1))
    assert set(_insert_zones(gcp)) == {"us-central1-a"}
    assert len(_insert_zones(gcp)) == 6


def test_given_zone_is_the_only_one_tried(gcp: Harness) -> None:
    gcp.fake.fail_operation(EXHAUSTED, zone="us-central1-b")
    with pytest.raises(CapacityError, match="us-central1-b"):
        gcp.up(gcp.request(zone="us-central1-b"))
    assert set(_insert_zones(gcp)) == {"us-central1-b"}


def test_regions_and_zones_options_order_the_search(gcp: Harness) -> None:
    gcp.fake.fail_operation(EXHAUSTED, region="europe-west4")
    p, _ = gcp.up(_req(gcp, num_nodes=1, gcp={"regions": ["europe-west4", "us-east1"]}))
    assert list(dict.fromkeys(z.rsplit("-", 1)[0] for z in _insert_zones(gcp))) == [
        "europe-west4", "us-east1"]
    gcp2 = gcp.provider()
    gcp2.create_nodes(_req(gcp, name="z", num_nodes=1, gcp={"zones": ["us-east1-d"]}),
                      gcp2.ensure_network(_req(gcp, name="z", num_nodes=1)))
    assert _insert_zones(gcp)[-1] == "us-east1-d"


def test_catalog_without_zones_asks_gce_for_the_region_zones(gcp: Harness) -> None:
    from cloudtrain.catalog.model import Offer

    offers = [Offer("gcp", "n1-standard-8", "T4", 1, 16, 8, 30, "asia-east1", (), price=0.9)]
    gcp.fake.fail_operation(EXHAUSTED, zone="asia-east1-a")
    p, _ = gcp.up(_req(gcp, offers=lambda: offers), gcp.provider(offers=lambda: offers))
    assert _tried(p)[-1][:2] == ("asia-east1-b", "ok")
    assert gcp.fake.calls("GET", "/regions/asia-east1$")
