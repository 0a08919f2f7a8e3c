"""What Azure says of each node (ReportsNodeHealth), against the ARM fake through the real SDK
clients: running; lost when evicted (policy Delete: the VM is gone; Deallocate:
PowerState/deallocated), stopped or deallocated; unknown on an API error; discard deletes the
VM, NIC, IP and disk of the named ranks only, and provisioning again recreates exactly those
ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("azure.mgmt.compute")
pytest.importorskip("azure.mgmt.network")
pytest.importorskip("azure.mgmt.resource")

from arm_fake import ArmFake, Harness, hermetic_env  # noqa: E402

from cloudtrain.provider import ReportsNodeHealth  # noqa: E402
from cloudtrain_provisioners.azure import tags as T  # noqa: E402


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, tmp_path / "home")
    finally:
        fake.stop()


def _names(az: Harness, cluster: str) -> set[str]:
    return {r["name"] for r in az.fake.tagged(cluster)
            if r["type"].split("/")[-1] in ("virtualMachines", "networkInterfaces",
                                            "publicIPAddresses", "disks")}


def test_running_evicted_deallocated_and_unknown(az: Harness) -> None:
    p, nodes = az.up(az.request(num_nodes=3, use_spot=True))
    assert isinstance(p, ReportsNodeHealth)
    fresh = az.provider()
    assert [(h.rank, h.state) for h in fresh.node_health("demo")] == [
        (0, "running"), (1, "running"), (2, "running")]
    az.fake.evict(T.vm_name("demo", 1))                       # policy Delete: gone
    az.fake.evict(T.vm_name("demo", 2), policy="Deallocate")  # deallocated
    got = {h.rank: h for h in fresh.node_health("demo")}
    assert got[0].state == "running" and got[0].instance_id == nodes[0].instance_id
    assert got[1].state == "lost" and "evicted" in got[1].reason
    assert got[2].state == "lost" and "deallocated" in got[2].reason

    az.fake.fail("GET", "virtualmachines", "AuthorizationFailed", status=403, times=None)
    assert [h.state for h in fresh.node_health("demo")] == ["unknown"] * 3


def test_discard_removes_only_those_ranks_and_up_recreates_them(az: Harness) -> None:
    p, nodes = az.up(az.request(num_nodes=3))
    az.up(az.request(name="other", num_nodes=2))
    other = _names(az, "other")
    az.fake.guest_shutdown(p.group("demo"), T.vm_name("demo", 2))
    assert [h.state for h in p.node_health("demo")] == ["running", "running", "lost"]
    before = _names(az, "demo")
    p.discard_nodes("demo", [2])
    left = _names(az, "demo")
    rank2 = {T.vm_name("demo", 2), T.nic_name("demo", 2), T.ip_name("demo", 2),
             T.disk_name("demo", 2)}
    assert left == before - rank2 and not (left & rank2)
    assert _names(az, "other") == other
    _, again = az.up(az.request(num_nodes=3))
    assert [n.instance_id for n in again][:2] == [n.instance_id for n in nodes][:2]
    assert _names(az, "demo") == before
    vm = az.fake.vm(T.vm_name("demo", 2))
    assert vm is not None and vm["tags"][T.CLUSTER] == "demo" and vm["tags"][T.RANK] == "2"
    assert [h.state for h in p.node_health("demo")] == ["running"] * 3
