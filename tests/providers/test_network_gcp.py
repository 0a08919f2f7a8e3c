"""The fast network on GCP against the Compute Engine REST fake (extended at the wire for
subnetworks, region operations and instances with several interfaces): A3 High gets 4 GPU
NIC networks for GPUDirect-TCPX, A3 Mega 8 for TCPXO, each with its subnetwork and the same
locked-down rules, all marked as the cluster's and all gone after teardown, also after an
``up`` that failed; a type without GPU NICs gets one interface; a project out of NETWORKS
quota gets a refusal that names the quota."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.provider.fabric import fabric_of  # noqa: E402
from cloudtrain.catalog.model import Offer  # noqa: E402
from cloudtrain.context import open_env  # noqa: E402
from cloudtrain.errors import ProviderError, UserError  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from cloudtrain_provisioners.gcp import tags as L  # noqa: E402
from gce_fake import TEST_CALLER_IP, Harness, fake_offers  # noqa: E402

ZONES = ("us-central1-a", "us-central1-b", "us-central1-c")


def offers() -> list[Any]:
    return [*fake_offers(),
            Offer("gcp", "a3-highgpu-8g", "H100", 8, 80, 208, 1872, "us-central1", ZONES,
                  price=88.0),
            Offer("gcp", "a3-megagpu-8g", "H100", 8, 80, 208, 1872, "us-central1", ZONES,
                  price=92.0)]


def _req(gcp: Harness, itype: str, **kw: Any) -> Any:
    return gcp.request(instance_type=itype, accelerators=None, offers=offers, **kw)


def _up(gcp: Harness, itype: str, **kw: Any) -> tuple[Any, list[Any]]:
    req = _req(gcp, itype, **kw)
    p = gcp.provider(offers=offers)
    p.check(req)
    p.plan(req)
    return gcp.up(req, p)


@pytest.mark.parametrize("itype", ["a3-highgpu-8g", "a3-megagpu-8g"])
def test_a3_gets_its_gpu_nic_networks_locked_down_and_all_deleted(gcp: Harness,
                                                                 itype: str) -> None:
    fab = fabric_of("gcp", itype)
    assert fab is not None
    p, nodes = _up(gcp, itype)
    f = gcp.fake
    gpu_nets = [n for n in f.network_res if n.rsplit("-", 1)[-1] in
                {f"g{i}" for i in range(fab.links)}]
    assert len(gpu_nets) == fab.links
    for net in gpu_nets:
        res = f.network_res[net]
        assert res["autoCreateSubnetworks"] is False and res["mtu"] == 8244
        assert L.marks(res["description"])[L.CLUSTER] == "demo"
        (sub,) = [s for (r, _n), s in f.subnetworks.items() if s["network"].endswith("/" + net)]
        assert sub["region"].endswith("/us-central1")
        assert L.marks(sub["description"])[L.CLUSTER] == "demo"
        rules = [fw for fw in f.firewalls.values() if fw["network"].endswith("/" + net)]
        assert len(rules) == 2
        ssh = next(r for r in rules if r["name"].endswith("-ssh"))
        internal = next(r for r in rules if not r["name"].endswith("-ssh"))
        assert ssh["sourceRanges"] == [f"{TEST_CALLER_IP}/32"]
        assert ssh["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
        assert len(internal["sourceRanges"]) == 1 and not internal.get("sourceTags")
        assert ipaddress.ip_network(sub["ipCidrRange"]).subnet_of(
            ipaddress.ip_network(internal["sourceRanges"][0]))   # the cluster's own range
        assert ipaddress.ip_network(internal["sourceRanges"][0]).is_private
        for r in rules:
            assert r["targetTags"] == [nodes_tag(f)] and L.marks(r["description"])
    for body in f.inserted_instances():
        nics = body["networkInterfaces"]
        assert len(nics) == 1 + fab.links
        assert [n["network"].rsplit("/", 1)[-1] for n in nics[1:]] == sorted(
            gpu_nets, key=lambda n: int(n.rsplit("-g", 1)[-1]))
        assert all(n["nicType"] == "GVNIC" for n in nics)
        assert nics[0]["accessConfigs"] and not any(n.get("accessConfigs") for n in nics[1:])
    (policy,) = f.policies.values()               # compact placement, named by every node
    assert policy["groupPlacementPolicy"] == {"collocation": "COLLOCATED"}
    assert L.marks(policy["description"])[L.CLUSTER] == "demo"
    assert all(b["resourcePolicies"] == [policy["selfLink"].split("/compute/v1/")[1]]
               for b in f.inserted_instances())
    env = p.node_env("demo")
    assert env["CLOUDTRAIN_FABRIC"] == fab.kind
    key = ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME" if fab.kind == "gpudirect-tcpx"
           else "NCCL_FASTRAK_IFNAME")
    assert len(env[key].split(",")) == fab.links
    p.terminate("demo")
    assert f.empty(), f.ours()


def nodes_tag(f: Any) -> str:
    (tag,) = {t for i in f.instances.values() for t in i["tags"]["items"]}
    return str(tag)


def test_a_type_without_gpu_nics_gets_one_interface(gcp: Harness) -> None:
    _up(gcp, "a2-highgpu-8g")
    assert all(len(b["networkInterfaces"]) == 1 for b in gcp.fake.inserted_instances())
    assert not gcp.fake.subnetworks and not gcp.fake.policies
    assert all("resourcePolicies" not in b for b in gcp.fake.inserted_instances())
    assert len(gcp.fake.ours()["networks"]) == 1


def test_a_failed_up_leaves_no_gpu_network(gcp: Harness) -> None:
    gcp.fake.fail_operation("INTERNAL_ERROR", "boom")
    task = parse_task("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: gcp\n"
                      "  region: us-central1\n  instance_type: a3-highgpu-8g\n")
    env = open_env(UI(quiet=True), {"gcp": gcp.provider(offers=offers)})
    with pytest.raises(ProviderError, match="boom"):
        provision(env, task, "demo")
    assert gcp.fake.calls("POST", "/subnetworks$")          # they were made, then removed
    assert gcp.fake.empty(), gcp.fake.ours()


def test_out_of_network_quota_is_refused_naming_it(gcp: Harness, tmp_path: Path) -> None:
    gcp.fake.network_quota = len(gcp.fake.network_res) + 3   # the cluster's own and 2 more
    with pytest.raises(UserError) as e:
        _up(gcp, "a3-highgpu-8g")
    assert "NETWORKS" in e.value.message and "resources.network: plain" in e.value.hint
    gcp.provider(offers=offers).terminate("demo")
    assert gcp.fake.empty(), gcp.fake.ours()
