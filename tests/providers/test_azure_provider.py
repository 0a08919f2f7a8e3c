"""The Azure provider against the ARM fake (real SDK clients over TLS on loopback): what it
creates and how (NSG rules, tags, VM settings, spot, image choice, adoption, endpoint
override). Assertions are about the resources that result, read back from the fake."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("azure.mgmt.compute")
pytest.importorskip("azure.mgmt.network")
pytest.importorskip("azure.mgmt.resource")

from arm_fake import SUBSCRIPTION, TEST_CALLER_IP, ArmFake, Harness, Sku, hermetic_env  # noqa: E402

from cloudtrain.catalog.model import Offer  # noqa: E402
from cloudtrain.errors import ProviderError, UserError  # noqa: E402
from cloudtrain_provisioners.azure import tags as T  # noqa: E402

TAG_KEYS = {T.CLUSTER, T.RANK, T.OWNER, T.CREATED}
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
ME = f"{TEST_CALLER_IP}/32"
VNET = "10.42.0.0/16"


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, tmp_path / "home")
    finally:
        fake.stop()


def _rules(az: Harness) -> set[tuple[str, int, str, str, str, str, str]]:
    (nsg,) = az.fake.of_type("networkSecurityGroups")
    out = set()
    for r in nsg["properties"]["securityRules"]:
        p = r["properties"]
        assert p["direction"] == "Inbound"
        out.add((r["name"], p["priority"], p["access"], p["protocol"], p["sourceAddressPrefix"],
                 p["destinationAddressPrefix"], p["destinationPortRange"]))
    return out


def test_nsg_has_exactly_the_rules_asked_for(az: Harness) -> None:
    az.up(az.request(ports=[8888, 6006]))
    assert _rules(az) == {
        ("ct-ssh", 100, "Allow", "Tcp", ME, VNET, "22"),
        ("ct-vnet", 110, "Allow", "*", VNET, VNET, "*"),
        ("ct-port-6006", 200, "Allow", "Tcp", ME, VNET, "6006"),
        ("ct-port-8888", 201, "Allow", "Tcp", ME, VNET, "8888"),
        ("ct-deny-inbound", 4096, "Deny", "*", "*", "*", "*"),
    }
    # nothing is allowed in from anywhere but the caller and the VNet itself
    for name, _, access, _, source, _, _ in _rules(az):
        if access == "Allow":
            assert source not in ("*", "0.0.0.0/0", "Internet", "Any"), name
    # the NSG guards the nodes' subnet
    (vnet,) = az.fake.of_type("virtualNetworks")
    (nsg,) = az.fake.of_type("networkSecurityGroups")
    (subnet,) = vnet["properties"]["subnets"]
    assert subnet["properties"]["networkSecurityGroup"]["id"] == nsg["id"]
    assert vnet["properties"]["addressSpace"]["addressPrefixes"] == [VNET]
    assert subnet["properties"]["addressPrefix"] == "10.42.0.0/20"

    # A later up reconciles: the task's new range and ports replace the old rules exactly.
    az.up(az.request(ports=[8888], ssh_cidr="198.51.100.0/24"))
    assert _rules(az) == {
        ("ct-ssh", 100, "Allow", "Tcp", "198.51.100.0/24", VNET, "22"),
        ("ct-vnet", 110, "Allow", "*", VNET, VNET, "*"),
        ("ct-port-8888", 200, "Allow", "Tcp", "198.51.100.0/24", VNET, "8888"),
        ("ct-deny-inbound", 4096, "Deny", "*", "*", "*", "*"),
    }
    assert len(az.fake.of_type("networkSecurityGroups")) == 1
    assert len(az.fake.of_type("virtualMachines")) == 2


def test_open_to_the_world_only_when_the_user_writes_it(az: Harness) -> None:
    az.up(az.request(num_nodes=1, ssh_cidr="0.0.0.0/0"))
    assert ("ct-ssh", 100, "Allow", "Tcp", "0.0.0.0/0", VNET, "22") in _rules(az)


def test_caller_ip_not_found_says_how_to_set_it_and_creates_nothing(az: Harness) -> None:
    def broken() -> str:
        raise OSError("network unreachable")

    p = az.provider(caller_ip=broken)
    with pytest.raises(UserError) as e:
        p.ensure_network(az.request())
    assert "resources.ssh_cidr" in e.value.hint and "network unreachable" in e.value.message
    assert az.fake.everything() == []


def test_every_resource_is_tagged(az: Harness) -> None:
    p, nodes = az.up(az.request())
    every = az.fake.everything()
    assert az.fake.counts() == {"resourceGroups": 1, "networkSecurityGroups": 1,
                                "virtualNetworks": 1, "publicIPAddresses": 2,
                                "networkInterfaces": 2, "virtualMachines": 2, "disks": 2}
    for r in every:
        tags = r.get("tags") or {}
        assert TAG_KEYS <= set(tags), f"{r['type']} {r['name']}: {tags}"
        assert tags[T.CLUSTER] == "demo" and tags[T.OWNER] == p.owner, r["name"]
        assert ISO.match(tags[T.CREATED]), r["name"]
        m = re.match(r"^demo-(\d)", r["name"])
        assert tags[T.RANK] == (m.group(1) if m else "all"), r["name"]
    # one resource group per cluster, and everything is in it
    (group,) = [r for r in every if r["type"] == "Microsoft.Resources/resourceGroups"]
    assert group["name"] == p.group("demo") and group["location"] == "eastus"
    assert all(f"/resourceGroups/{group['name']}/" in r["id"] for r in every if r is not group)


def test_vm_settings_ssh_key_only_one_zone_public_ip_and_nic(az: Harness) -> None:
    req = az.request()
    p, nodes = az.up(req)
    vms = sorted(az.fake.of_type("virtualMachines"), key=lambda v: v["name"])
    assert [v["name"] for v in vms] == ["demo-0", "demo-1"]
    assert {tuple(v["zones"]) for v in vms} == {("1",)}            # one zone for the cluster
    for v in vms:
        props = v["properties"]
        assert props["hardwareProfile"]["vmSize"] == "Standard_ND96asr_v4"
        osp = props["osProfile"]
        assert osp["adminUsername"] == "azureuser" and "adminPassword" not in osp
        lin = osp["linuxConfiguration"]
        assert lin["disablePasswordAuthentication"] is True
        (key,) = lin["ssh"]["publicKeys"]
        assert key["keyData"] == req.public_key.strip()
        assert key["path"] == "/home/azureuser/.ssh/authorized_keys"
        disk = props["storageProfile"]["osDisk"]
        assert disk["diskSizeGB"] == 200 and disk["deleteOption"] == "Delete"
        assert disk["managedDisk"]["storageAccountType"] == "Premium_LRS"
        assert "priority" not in props and "evictionPolicy" not in props
    for pip in az.fake.of_type("publicIPAddresses"):
        assert pip["sku"]["name"] == "Standard"
        assert pip["properties"]["publicIPAllocationMethod"] == "Static"
    for nic in az.fake.of_type("networkInterfaces"):
        assert nic["properties"]["enableAcceleratedNetworking"] is True
    by_ip = {pip["properties"]["ipAddress"]: pip for pip in az.fake.of_type("publicIPAddresses")}
    assert [n.rank for n in nodes] == [0, 1]
    for n in nodes:
        assert n.host in by_ip and n.internal_ip.startswith("10.42.") and n.user == "azureuser"
        assert n.status == "running" and n.instance_id.endswith(f"/virtualMachines/demo-{n.rank}")
    assert p.list_nodes("demo") == nodes


def test_old_size_gets_plain_ubuntu_no_zone_no_accelerated_networking(az: Harness) -> None:
    az.up(az.request(num_nodes=1, region="southcentralus", instance_type="Standard_NC6"))
    (vm,) = az.fake.of_type("virtualMachines")
    assert vm["properties"]["storageProfile"]["imageReference"] == {
        "publisher": "Canonical", "offer": "0001-com-ubuntu-server-jammy", "sku": "22_04-lts",
        "version": "latest"}
    assert "zones" not in vm                                       # the size has no zones there
    assert vm["properties"]["storageProfile"]["osDisk"]["managedDisk"][
        "storageAccountType"] == "StandardSSD_LRS"
    (nic,) = az.fake.of_type("networkInterfaces")
    assert nic["properties"]["enableAcceleratedNetworking"] is False


def test_default_image_is_the_ubuntu_hpc_image(az: Harness) -> None:
    az.up(az.request(num_nodes=1, region="eastus", instance_type="Standard_NC4as_T4_v3"))
    (vm,) = az.fake.of_type("virtualMachines")
    assert vm["properties"]["storageProfile"]["imageReference"] == {
        "publisher": "microsoft-dsvm", "offer": "ubuntu-hpc", "sku": "2204", "version": "latest"}


def test_image_override_urn_and_image_id(az: Harness) -> None:
    urn = "Canonical:0001-com-ubuntu-server-jammy:22_04-lts-gen2:22.04.2025010101"
    az.up(az.request(num_nodes=1, image=urn))
    (vm,) = az.fake.of_type("virtualMachines")
    assert vm["properties"]["storageProfile"]["imageReference"] == dict(zip(
        ("publisher", "offer", "sku", "version"), urn.split(":")))
    gallery = (f"/subscriptions/{SUBSCRIPTION}/resourceGroups/images/providers/Microsoft.Compute/"
               "galleries/g/images/train/versions/1.0.0")
    az.up(az.request(name="other", num_nodes=1, image=gallery))
    (vm,) = az.fake.of_type("virtualMachines", group=az.provider().group("other"))
    assert vm["properties"]["storageProfile"]["imageReference"] == {"id": gallery}
    with pytest.raises(UserError, match="neither an image URN"):
        az.provider().check(az.request(image="ubuntu-22.04"))


def test_spot_settings(az: Harness) -> None:
    _, nodes = az.up(az.request(use_spot=True))
    for vm in az.fake.of_type("virtualMachines"):
        props = vm["properties"]
        assert props["priority"] == "Spot" and props["evictionPolicy"] == "Delete"
        assert props["billingProfile"] == {"maxPrice": -1}            # up to the on-demand price
    assert all(n.spot for n in nodes)
    az.up(az.request(name="capped", num_nodes=1, use_spot=True, azure={"spot_max_price": 3.5}))
    (vm,) = az.fake.of_type("virtualMachines", group=az.provider().group("capped"))
    assert vm["properties"]["billingProfile"] == {"maxPrice": 3.5}


def test_second_up_adopts_and_never_double_creates(az: Harness) -> None:
    req = az.request()
    _, first = az.up(req)
    _, again = az.up(req)                       # a new provider: nothing cached in memory
    assert [n.instance_id for n in again] == [n.instance_id for n in first]
    assert len(az.fake.ops_of("PUT", "virtualmachines")) == 2
    assert az.fake.counts()["virtualMachines"] == 2
    # a node that went away (e.g. evicted) is replaced alone, in the cluster's zone
    az.fake.evict("demo-1")
    _, third = az.up(req)
    puts = az.fake.ops_of("PUT", "virtualmachines")
    assert len(puts) == 3 and puts[-1].name == "demo-1" and puts[-1].zone == "1"
    assert [n.rank for n in third] == [0, 1] and third[0].instance_id == first[0].instance_id
    assert len(az.fake.of_type("networkInterfaces")) == 2          # its NIC was reused


def test_a_vm_left_failed_is_deleted_and_made_again(az: Harness) -> None:
    req = az.request(num_nodes=1)
    az.up(req)
    (vm,) = az.fake.of_type("virtualMachines")
    with az.fake.lock:                       # e.g. a host failure Azure could not recover from
        az.fake.resources[vm["id"].lower()]["properties"]["provisioningState"] = "Failed"
    _, nodes = az.up(req)
    assert [n.status for n in nodes] == ["running"]
    assert [(r.method, r.name) for r in az.fake.requests if r.kind == "virtualmachines"
            and r.method in ("PUT", "DELETE")] == [("PUT", "demo-0"), ("DELETE", "demo-0"),
                                                   ("PUT", "demo-0")]
    assert "failed to provision" in az.messages()
    (vm,) = az.fake.of_type("virtualMachines")
    assert vm["properties"]["provisioningState"] == "Succeeded"


def test_check_refuses_what_cannot_work(az: Harness) -> None:
    p = az.provider()
    with pytest.raises(UserError, match="not an Azure availability zone"):
        p.check(az.request(zone="eastus-1"))
    with pytest.raises(UserError, match="zone is given without"):
        p.check(az.request(region=None, zone="2"))
    with pytest.raises(UserError, match="accelerators"):
        p.check(az.request(accelerators=None))
    assert az.fake.calls == []                                   # check calls nothing


def test_accelerators_pick_the_catalog_size_and_price(az: Harness) -> None:
    offers = [Offer("azure", "Standard_NC24ads_A100_v4", "A100-80GB", 1, 80, 24, 220, "eastus",
                    price=3.67)]
    p = az.provider(offers=lambda: offers)
    req = az.request(num_nodes=1, accelerators="A100-80GB:1", offers=lambda: offers)
    plan = p.plan(req)
    assert plan.instance_type == "Standard_NC24ads_A100_v4" and plan.hourly_price_per_node == 3.67
    az.up(req, p)
    (vm,) = az.fake.of_type("virtualMachines")
    assert vm["properties"]["hardwareProfile"]["vmSize"] == "Standard_NC24ads_A100_v4"


def test_plan_shows_the_rules_and_price_and_calls_nothing(az: Harness) -> None:
    plan = az.provider().plan(az.request(ports=[8888], ssh_cidr="198.51.100.0/24", use_spot=True))
    text = "\n".join(plan.creates + plan.notes)
    assert "tcp 22 from 198.51.100.0/24" in text and "tcp 8888 from 198.51.100.0/24" in text
    assert f"all traffic from {VNET}" in text and "deny every other inbound flow" in text
    assert "eviction policy Delete" in text and "SSH key only" in text
    assert "microsoft-dsvm:ubuntu-hpc:2204:latest" in text
    assert plan.use_spot and plan.hourly_price_per_node == pytest.approx(2.99167)
    assert az.fake.calls == [] and az.fake.everything() == []


def test_no_subscription_anywhere_says_how_to_give_one(az: Harness,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID")
    with pytest.raises(UserError, match="No Azure subscription") as e:
        az.provider().ensure_network(az.request())
    assert "AZURE_SUBSCRIPTION_ID" in e.value.hint
    # the task's subscription is used when given
    az.up(az.request(num_nodes=1, azure={"subscription_id": SUBSCRIPTION}))
    assert az.fake.counts()["virtualMachines"] == 1


def test_the_azure_cli_default_subscription_is_used(az: Harness, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain_provisioners.azure.api import default_subscription

    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID")
    cfg = tmp_path / "azcfg"
    cfg.mkdir()
    (cfg / "azureProfile.json").write_text(
        '\ufeff{"subscriptions": [{"id": "11111111-1111-4111-8111-111111111111", "isDefault": false},'
        ' {"id": "%s", "isDefault": true}]}' % SUBSCRIPTION, encoding="utf-8")
    monkeypatch.setenv("AZURE_CONFIG_DIR", str(cfg))
    assert default_subscription() == SUBSCRIPTION


def test_endpoint_ca_bundle_and_token_from_the_environment(az: Harness,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What a sovereign or private cloud needs, and what the end-to-end test uses."""
    from cloudtrain_provisioners.azure.api import AzureClients

    monkeypatch.setenv("CLOUDTRAIN_AZURE_ARM_ENDPOINT", az.fake.url)
    monkeypatch.setenv("CLOUDTRAIN_AZURE_ACCESS_TOKEN", az.fake.token)
    monkeypatch.setenv("CLOUDTRAIN_AZURE_POLL_INTERVAL", "0")
    clients = AzureClients(retry_total=0)
    assert clients.scope == f"{az.fake.url}/.default" and clients.polling_interval == 0
    # without the CA bundle the self-signed certificate is refused: nothing is sent
    p = az.provider(clients=clients)
    with pytest.raises(ProviderError, match="CLOUDTRAIN_AZURE_CA_BUNDLE"):
        p.list_nodes("demo")
    assert az.fake.calls == []
    monkeypatch.setenv("CLOUDTRAIN_AZURE_CA_BUNDLE", str(az.fake.cert_file))
    p = az.provider(clients=AzureClients(retry_total=0))
    assert p.list_nodes("demo") == []
    _, nodes = az.up(az.request(num_nodes=1), p)
    assert len(nodes) == 1 and az.fake.counts()["virtualMachines"] == 1


def test_wrong_token_is_an_auth_error_that_stops(az: Harness) -> None:
    from arm_fake import FakeCredential

    from cloudtrain.errors import AuthError
    from cloudtrain_provisioners.azure.api import AzureClients

    clients = AzureClients(credential=FakeCredential("not-the-token"), endpoint=az.fake.url,
                           ca_bundle=str(az.fake.cert_file), polling_interval=0, retry_total=0)
    with pytest.raises(AuthError, match="InvalidAuthenticationToken"):
        az.up(az.request(), az.provider(clients=clients))
    assert az.fake.everything() == []


def test_loading_the_provider_imports_no_sdk(tmp_path: Path) -> None:
    code = ("import sys\nfrom pathlib import Path\n"
            "from cloudtrain.provider import ProviderContext\n"
            "from cloudtrain_provisioners.azure import AzureProvider\n"
            "p = AzureProvider(ProviderContext(Path(sys.argv[1])))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'azure'))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_size_restricted_in_a_zone_is_not_tried_there(az: Harness) -> None:
    az.fake.add_sku("eastus", Sku("Standard_ND96asr_v4", zones=("1", "2", "3"),
                                  generations=("V2",), restricted_zones=("1",)))
    az.up(az.request())
    assert {tuple(v["zones"]) for v in az.fake.of_type("virtualMachines")} == {("2",)}
    assert [r.zone for r in az.fake.ops_of("PUT", "virtualmachines")] == ["2", "2"]


def test_private_addresses_only_when_asked(az: Harness) -> None:
    _, nodes = az.up(az.request(azure={"public_ip": False}))
    assert az.fake.of_type("publicIPAddresses") == []
    for nic in az.fake.of_type("networkInterfaces"):
        assert "publicIPAddress" not in nic["properties"]["ipConfigurations"][0]["properties"]
    assert [n.host for n in nodes] == [n.internal_ip for n in nodes]
    assert all(n.host.startswith("10.42.0.") for n in nodes)


def test_nodes_are_what_azure_gives_and_stand_ins_are_reached_through_the_proxy(
        az: Harness, tmp_path: Path) -> None:
    """The provider hands back plain nodes (the VM's public address, port 22, the admin user,
    files under ~/cloudtrain, the private address Azure gave: here the stand-ins' own, through
    the fake's ``private_address``); the tests' proxy reaches only what its map gives."""
    import subprocess
    import sys

    import standin
    from cloudtrain.provider import HasMasterPort

    az.fake.private_address = lambda nic: f"127.0.0.{10 + int(nic.rsplit('-', 2)[1])}"
    p = az.provider()
    _, nodes = az.up(az.request(), p)
    assert [(n.port, n.internal_ip, n.user, n.root_dir) for n in nodes] == [
        (22, "127.0.0.10", "azureuser", "cloudtrain"), (22, "127.0.0.11", "azureuser", "cloudtrain")]
    assert all(n.host and n.host != n.internal_ip for n in nodes)
    assert not isinstance(p, HasMasterPort) and p.node_env("demo") == {}   # plain network
    assert p.list_nodes("demo") == nodes
    # the proxy map gives node 0's address only: node 1's (invented by the fake) is refused
    f = tmp_path / "proxy-map.json"
    standin.ProxyMap(f).add({nodes[0].host: ("127.0.0.10", 2200)})
    r = subprocess.run([sys.executable, str(standin.PROXY), str(f), nodes[1].host, "22", "0"],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "refusing to connect" in r.stderr
    assert standin.ProxyMap(f).relayed == []
