"""Azure failover with errors injected by the ARM fake (synchronous error responses, or
long-running operations that end Failed): which zones and regions are tried in which order,
the reason kept for each, partial launches rolled back, credential errors stopping at once,
throttling retried. The provider switches on the ARM error code, never the HTTP status."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("azure.mgmt.compute")

from arm_fake import ArmFake, Harness, Req, hermetic_env  # noqa: E402

from cloudtrain.catalog.model import Offer  # noqa: E402
from cloudtrain.context import open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.errors import AuthError, CapacityError, ProviderError, QuotaError  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402

SIZE = "Standard_ND96asr_v4"
PRICES = {"eastus": 27.0, "westus2": 28.0, "southcentralus": 32.0}
OFFERS = [Offer("azure", SIZE, "A100", 8, 40, 96, 900, r, price=p, spot_price=p / 9)
          for r, p in PRICES.items()]
QUOTA_MSG = ("Operation could not be completed as it results in exceeding approved "
             "standardNDASv4_A100Family Cores quota. Current Limit: 0, Current Usage: 0, "
             "Additional Required: 96.")


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, tmp_path / "home")
    finally:
        fake.stop()


def _provider(az: Harness):  # type: ignore[no-untyped-def]
    return az.provider(offers=lambda: OFFERS)


def _req(az: Harness, **kw):  # type: ignore[no-untyped-def]
    """A request that names no region: the provider picks them in price order."""
    return az.request(region=None, offers=lambda: OFFERS, **kw)


def _up(az: Harness, req, p=None):  # type: ignore[no-untyped-def]
    return az.up(req, p or _provider(az))


def _tried(p, name: str = "demo") -> list[tuple[str, str | None, str, str]]:  # type: ignore[no-untyped-def]
    return [(a["region"], a["zone"], a["outcome"], a["code"]) for a in p.attempts(name)]


def _where(az: Harness) -> set[tuple[str, str | None]]:
    return {(v["location"], (v.get("zones") or [None])[0]) for v in az.fake.of_type("virtualMachines")}


def _vm_puts(az: Harness) -> list[tuple[str, str | None, str]]:
    return [(r.location, r.zone, r.name) for r in az.fake.ops_of("PUT", "virtualmachines")]


def _in(location: str, zone: str | None = None):  # type: ignore[no-untyped-def]
    def when(r: Req) -> bool:
        return r.location == location and (zone is None or r.zone == zone)
    return when


def test_capacity_moves_to_the_next_zone_and_keeps_each_reason(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "ZonalAllocationFailed", mode="async", times=None,
                 when=_in("eastus", "1"))
    p, nodes = _up(az, _req(az))
    assert _tried(p) == [("eastus", "1", "capacity", "ZonalAllocationFailed"),
                         ("eastus", "2", "ok", "launched")]
    assert _where(az) == {("eastus", "2")}
    assert len(nodes) == 2
    # the failed zone's VMs (left Failed by Azure) were deleted before the next zone was tried
    seq = [(r.method, r.name, r.zone) for r in az.fake.requests
           if r.kind == "virtualmachines" and r.method in ("PUT", "DELETE")]
    assert sorted(seq[:2]) == [("PUT", "demo-0", "1"), ("PUT", "demo-1", "1")]
    assert sorted(seq[2:4]) == [("DELETE", "demo-0", None), ("DELETE", "demo-1", None)]
    assert sorted(seq[4:]) == [("PUT", "demo-0", "2"), ("PUT", "demo-1", "2")]
    # the reasons are kept with the cluster, for a later look
    again = _provider(az)
    assert _tried(again) == _tried(p)
    assert "eastus zone 1 (Standard_ND96asr_v4): capacity: ZonalAllocationFailed" in az.messages()


@pytest.mark.parametrize("code", ["AllocationFailed", "OverconstrainedAllocationRequest",
                                  "SkuNotAvailable"])
def test_capacity_codes_sync_or_async(az: Harness, code: str) -> None:
    mode = "sync" if code == "SkuNotAvailable" else "async"
    az.fake.fail("PUT", "virtualmachines", code, mode=mode, times=None, when=_in("eastus", "1"))
    p, _ = _up(az, _req(az, num_nodes=1))
    assert _tried(p) == [("eastus", "1", "capacity", code), ("eastus", "2", "ok", "launched")]


def test_zones_in_turn_then_regions_in_price_order(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "AllocationFailed", mode="async", times=None,
                 when=_in("eastus"))
    p, nodes = _up(az, _req(az))
    assert _tried(p) == [("eastus", "1", "capacity", "AllocationFailed"),
                         ("eastus", "2", "capacity", "AllocationFailed"),
                         ("westus2", "1", "ok", "launched")]
    assert _where(az) == {("westus2", "1")}
    # the cluster moved whole: one resource group, now in westus2, and nothing in eastus
    groups = [r for r in az.fake.everything() if r["type"] == "Microsoft.Resources/resourceGroups"]
    assert [g["location"] for g in groups] == ["westus2"]
    assert {r["location"] for r in az.fake.everything()} == {"westus2"}


def test_quota_moves_to_the_next_region_at_once(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "QuotaExceeded", times=None, when=_in("eastus"))
    p, _ = _up(az, _req(az))
    assert _tried(p) == [("eastus", "1", "quota", "QuotaExceeded"),
                         ("westus2", "1", "ok", "launched")]
    assert [z for loc, z, _ in _vm_puts(az) if loc == "eastus"] == ["1", "1"]   # not zone 2


def test_operation_not_allowed_is_quota_only_when_it_says_so(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "OperationNotAllowed", QUOTA_MSG, times=None,
                 when=_in("eastus"))
    p, _ = _up(az, _req(az, num_nodes=1))
    assert _tried(p)[0] == ("eastus", "1", "quota", "OperationNotAllowed")
    assert _where(az) == {("westus2", "1")}

    az.fake.clear_faults()
    az.fake.fail("PUT", "virtualmachines", "OperationNotAllowed",
                 "The operation is not allowed while the disk is being resized.")
    with pytest.raises(ProviderError) as e:
        _up(az, _req(az, name="other", num_nodes=1))
    assert not isinstance(e.value, (CapacityError, QuotaError))
    assert "being resized" in e.value.message
    assert [z for loc, z, n in _vm_puts(az) if n.startswith("other")] == ["1"]   # no failover


def test_spot_capacity_and_spot_quota(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "SkuNotAvailable", times=None, when=_in("eastus", "1"))
    az.fake.fail("PUT", "virtualmachines", "OperationNotAllowed",
                 "Operation results in exceeding quota limits of Total Regional Low-priority "
                 "vCPUs. Maximum allowed: 0", times=None, when=_in("eastus", "2"))
    p, _ = _up(az, _req(az, num_nodes=1, use_spot=True))
    assert _tried(p) == [("eastus", "1", "capacity", "SkuNotAvailable"),
                         ("eastus", "2", "quota", "OperationNotAllowed"),
                         ("westus2", "1", "ok", "launched")]
    (vm,) = az.fake.of_type("virtualMachines")
    assert vm["properties"]["priority"] == "Spot"


def test_partial_launch_is_rolled_back_before_moving_on(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "AllocationFailed", mode="async",
                 when=lambda r: r.zone == "1" and r.rank == "1")
    p, nodes = _up(az, _req(az))
    assert _tried(p) == [("eastus", "1", "capacity", "AllocationFailed"),
                         ("eastus", "2", "ok", "launched")]
    deletes = [r.name for r in az.fake.ops_of("DELETE", "virtualmachines")]
    assert sorted(deletes) == ["demo-0", "demo-1"]    # rank 0 got one, then gave it back
    assert _where(az) == {("eastus", "2")}
    assert "deleting the 2 VM(s) this attempt got" in az.messages()
    assert [n.rank for n in nodes] == [0, 1]
    # the NICs and IPs were kept for the next zone, not made twice
    assert len(az.fake.ops_of("PUT", "networkinterfaces")) == 2
    assert len(az.fake.of_type("publicIPAddresses")) == 2


def test_nothing_in_any_zone_gives_up_with_every_attempt_and_leaves_nothing(az: Harness) -> None:
    """Through the core: the region is given, every zone is out of capacity."""
    az.fake.fail("PUT", "virtualmachines", "ZonalAllocationFailed", mode="async", times=None)
    env = open_env(UI(quiet=True), {"azure": _provider(az)})
    task = parse_task("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: azure\n"
                      "  region: eastus\n  accelerators: A100:8\n"
                      "  network: plain\n")   # zones: an InfiniBand availability set has none
    with pytest.raises(CapacityError) as e:
        provision(env, task, "demo")
    msg = e.value.message
    assert "after 2 attempt(s)" in msg
    for zone in ("1", "2"):
        assert f"eastus zone {zone}: ZonalAllocationFailed" in msg
    assert "another region" in e.value.hint
    assert az.fake.tagged() == [] and az.fake.everything() == []
    assert env.state.get_cluster("demo") is None


def test_planner_fails_over_to_its_next_region(az: Harness) -> None:
    """No region in the task: the planner ranks the catalog's regions, up takes the cheapest;
    when it has no capacity, the cluster is rolled back and the next one is tried."""
    az.fake.fail("PUT", "virtualmachines", "AllocationFailed", mode="async", times=None,
                 when=_in("eastus"))
    env = open_env(UI(quiet=True), {"azure": az.provider()})
    task = parse_task("name: demo\nnum_nodes: 1\nrun: echo hi\nresources:\n  provider: azure\n"
                      "  accelerators: A100:8\n")
    handle, _ = provision(env, task, "demo")
    assert handle.row.region == "westus2"
    assert {r["location"] for r in az.fake.everything()} == {"westus2"}
    assert {loc for loc, _, _ in _vm_puts(az)} == {"eastus", "westus2"}


def test_nothing_in_any_region_names_every_attempt(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "AllocationFailed", mode="async", times=None)
    with pytest.raises(CapacityError) as e:
        _up(az, _req(az))
    for where in ("eastus zone 1", "eastus zone 2", "westus2 zone 2", "southcentralus zone 1"):
        assert f"{where}: AllocationFailed" in e.value.message
    assert az.fake.of_type("virtualMachines") == []


def test_quota_everywhere_is_a_quota_error(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "QuotaExceeded", times=None)
    with pytest.raises(QuotaError, match="3 attempt"):
        _up(az, _req(az))


@pytest.mark.parametrize("code", ["AuthorizationFailed", "InvalidAuthenticationToken",
                                  "LinkedAuthorizationFailed"])
def test_credentials_problem_stops_at_once(az: Harness, code: str) -> None:
    az.fake.fail("PUT", "virtualmachines", code, status=403)
    p = _provider(az)
    with pytest.raises(AuthError) as e:
        _up(az, _req(az), p)
    assert "az login" in e.value.hint
    assert {loc for loc, _, _ in _vm_puts(az)} == {"eastus"}
    assert [a["outcome"] for a in p.attempts("demo")] == ["auth"]


def test_unavailable_size_or_image_moves_to_the_next_region(az: Harness) -> None:
    az.fake.remove_sku("eastus", SIZE)
    with az.fake.lock:
        del az.fake.images[("westus2", "microsoft-dsvm", "ubuntu-hpc", "2204")]
    p, _ = _up(az, _req(az, num_nodes=1))
    assert [(a["region"], a["outcome"]) for a in p.attempts("demo")] == [
        ("eastus", "unavailable"), ("westus2", "unavailable"), ("southcentralus", "ok")]
    assert "not sold in eastus" in p.attempts("demo")[0]["code"]
    assert "not offered in westus2" in p.attempts("demo")[1]["code"]


def test_throttling_is_retried_with_backoff_in_place(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "TooManyRequests", status=429, times=2,
                 when=lambda r: r.rank == "0")
    p, nodes = _up(az, _req(az))
    assert len(nodes) == 2
    assert len(az.sleeps) >= 2 and az.sleeps[1] > az.sleeps[0] * 0.5 > 0
    assert _tried(p) == [("eastus", "1", "ok", "launched")]


def test_given_zone_is_the_only_one_tried(az: Harness) -> None:
    az.fake.fail("PUT", "virtualmachines", "ZonalAllocationFailed", mode="async", times=None)
    with pytest.raises(CapacityError):
        _up(az, az.request(zone="2", offers=lambda: OFFERS))
    assert {z for _, z, _ in _vm_puts(az)} == {"2"}


def test_regions_option_orders_the_regions(az: Harness) -> None:
    p, _ = _up(az, _req(az, num_nodes=1, azure={"regions": ["southcentralus", "eastus"]}))
    assert _where(az) == {("southcentralus", "1")}
    assert _provider(az).plan(_req(az, azure={"regions": ["southcentralus", "eastus"]})).region \
        == "southcentralus"


def test_zones_option_orders_the_zones(az: Harness) -> None:
    p, _ = _up(az, az.request(num_nodes=1, azure={"zones": ["2", "1"]}, offers=lambda: OFFERS))
    assert _where(az) == {("eastus", "2")}
