"""The fast network on Azure against the ARM fake (real SDK clients over TLS on loopback): a
multi-node cluster of an InfiniBand ND size goes into one availability set of its own, in a
proximity placement group, with no zone (ARM refuses both), on the HPC image, and its jobs get
the NCCL/UCX settings; a size without InfiniBand, ``network: plain`` and one node do not; all of
it goes with the cluster's resource group."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("azure.mgmt.compute")

from arm_fake import ArmFake, Harness, hermetic_env  # noqa: E402
from cloudtrain.provider.fabric import fabric_of  # noqa: E402


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, tmp_path / "home")
    finally:
        fake.stop()


@pytest.mark.parametrize("size,topo", [("Standard_ND96asr_v4", "ndv4"),
                                       ("Standard_ND96isr_H100_v5", "ndv5")])
def test_infiniband_sizes_share_one_availability_set(az: Harness, size: str, topo: str) -> None:
    assert fabric_of("azure", size) is not None
    p, nodes = az.up(az.request(instance_type=size, accelerators=None))
    (ppg,) = az.fake.of_type("proximityPlacementGroups")
    (aset,) = az.fake.of_type("availabilitySets")
    assert aset["sku"] == {"name": "Aligned"}
    assert aset["properties"]["proximityPlacementGroup"]["id"].lower() == ppg["id"].lower()
    assert aset["tags"]["cloudtrain:cluster"] == "demo" and ppg["tags"]["cloudtrain:cluster"]
    vms = az.fake.of_type("virtualMachines")
    assert len(vms) == 2 == len(nodes)
    for vm in vms:
        assert vm["properties"]["availabilitySet"]["id"].lower() == aset["id"].lower()
        assert not vm.get("zones")
        assert vm["properties"]["storageProfile"]["imageReference"]["offer"] == "ubuntu-hpc"
    env = p.node_env("demo")
    assert env["CLOUDTRAIN_FABRIC"] == "infiniband"
    assert env["NCCL_IB_PCI_RELAXED_ORDERING"] == "1" and env["UCX_IB_PCI_RELAXED_ORDERING"] == "on"
    assert env["NCCL_TOPO_FILE"] == f"/opt/microsoft/{topo}-topo.xml"
    p.terminate("demo")
    assert az.fake.tagged("demo") == []


@pytest.mark.parametrize("kw", [{"instance_type": "Standard_NC24ads_A100_v4"},
                                {"instance_type": "Standard_ND96asr_v4", "network": "plain"},
                                {"instance_type": "Standard_ND96asr_v4", "num_nodes": 1}])
def test_no_availability_set_without_the_fabric(az: Harness, kw: dict[str, object]) -> None:
    nodes = int(kw.pop("num_nodes", 2))  # type: ignore[call-overload]
    p, _ = az.up(az.request(accelerators=None, num_nodes=nodes, **kw))
    assert az.fake.of_type("availabilitySets") == []
    assert all("availabilitySet" not in vm["properties"]
               for vm in az.fake.of_type("virtualMachines"))
    assert p.node_env("demo") == {}
