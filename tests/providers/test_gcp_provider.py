"""The GCP provider against the Compute Engine REST fake (tests/fakes/gce_fake.py), through the real
google-cloud-compute clients: firewall rules, labels, instance settings (GPUs, spot, image,
boot disk, SSH key), adoption, addresses, credentials and project."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.errors import AuthError, UserError  # noqa: E402
from cloudtrain_provisioners.gcp import tags as L  # noqa: E402
from gce_fake import DLVM_FAMILIES, DLVM_PROJECT, TEST_CALLER_IP, Harness  # noqa: E402

OWNER = L.owner_value("alice@laptop.example")



def _base(name: str = "demo") -> str:
    return L.base_name(name, "alice@laptop.example")


def _rules(h: Harness) -> dict[str, dict]:  # type: ignore[type-arg]
    # cloudtrain's rules (the default network's default-allow-* rules are the project's)
    return {n: f for n, f in h.fake.firewalls.items() if n.startswith("ct-")}


def test_firewall_rules_are_exactly_ssh_internal_and_ports(gcp: Harness) -> None:
    gcp.up(gcp.request(ports=[6006, 8888]))
    base = _base()
    rules = _rules(gcp)
    assert sorted(rules) == [f"{base}-internal", f"{base}-ports", f"{base}-ssh"]
    ssh, internal, ports = rules[f"{base}-ssh"], rules[f"{base}-internal"], rules[f"{base}-ports"]
    assert ssh["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert ssh["sourceRanges"] == [f"{TEST_CALLER_IP}/32"] and "sourceTags" not in ssh
    assert internal["allowed"] == [{"IPProtocol": "all"}]
    assert internal["sourceTags"] == [base] and "sourceRanges" not in internal
    assert ports["allowed"] == [{"IPProtocol": "tcp", "ports": ["6006", "8888"]}]
    assert ports["sourceRanges"] == [f"{TEST_CALLER_IP}/32"]
    for fw in rules.values():
        assert fw["direction"] == "INGRESS" and fw["targetTags"] == [base]
        # the cluster's own network (created with it), not the project's default network
        assert fw["network"].endswith(f"/global/networks/{base}-net")
        assert "0.0.0.0/0" not in fw.get("sourceRanges", [])
        assert L.marks(fw["description"])[L.CLUSTER] == "demo"
        assert L.marks(fw["description"])[L.OWNER] == OWNER
    # every node carries the tag the rules aim at
    for body in gcp.fake.inserted_instances():
        assert body["tags"] == {"items": [base]}


def test_ssh_cidr_from_the_task_and_no_ports_rule(gcp: Harness) -> None:
    gcp.up(gcp.request(ssh_cidr="198.51.100.0/24"))
    base = _base()
    assert sorted(_rules(gcp)) == [f"{base}-internal", f"{base}-ssh"]
    assert _rules(gcp)[f"{base}-ssh"]["sourceRanges"] == ["198.51.100.0/24"]


def test_firewall_rules_follow_the_task_on_the_next_up(gcp: Harness) -> None:
    p = gcp.provider()
    p.ensure_network(gcp.request(ports=[6006]))
    p.ensure_network(gcp.request(ssh_cidr="198.51.100.0/24"))
    base = _base()
    assert sorted(_rules(gcp)) == [f"{base}-internal", f"{base}-ssh"]
    assert _rules(gcp)[f"{base}-ssh"]["sourceRanges"] == ["198.51.100.0/24"]
    # the same task again changes nothing
    before = len(gcp.fake.requests)
    p.ensure_network(gcp.request(ssh_cidr="198.51.100.0/24"))
    assert not [r for r in gcp.fake.requests[before:] if r["method"] != "GET"]


def test_a_foreign_rule_with_our_name_is_not_taken_over(gcp: Harness) -> None:
    base = _base()
    gcp.fake.firewalls[f"{base}-ssh"] = {"name": f"{base}-ssh", "description": "mine",
                                         "allowed": [{"IPProtocol": "tcp"}],
                                         "sourceRanges": ["0.0.0.0/0"]}
    with pytest.raises(UserError, match="not created by cloudtrain"):
        gcp.provider().ensure_network(gcp.request())
    assert gcp.fake.firewalls[f"{base}-ssh"]["description"] == "mine"


def test_n1_with_attached_t4_on_demand(gcp: Harness) -> None:
    req = gcp.request(disk_size_gb=250)
    p, nodes = gcp.up(req)
    bodies = gcp.fake.inserted_instances()
    assert sorted(b["name"] for b in bodies) == [f"{_base()}-0", f"{_base()}-1"]
    for b in bodies:
        rank = b["name"].rsplit("-", 1)[1]
        zone = b["_zone"]
        assert b["labels"] == {L.CLUSTER: "demo", L.RANK: rank, L.OWNER: OWNER}
        assert b["machineType"] == f"zones/{zone}/machineTypes/n1-standard-8"
        assert b["guestAccelerators"] == [{
            "acceleratorType": f"projects/test-project/zones/{zone}/acceleratorTypes/"
                               "nvidia-tesla-t4", "acceleratorCount": 1}]
        assert b["scheduling"] == {"onHostMaintenance": "TERMINATE",
                                   "provisioningModel": "STANDARD", "automaticRestart": True}
        (disk,) = b["disks"]
        assert disk["boot"] is True and disk["autoDelete"] is True
        init = disk["initializeParams"]
        assert init["diskSizeGb"] == "250"
        assert init["sourceImage"] == (f"projects/{DLVM_PROJECT}/global/images/family/"
                                       f"{DLVM_FAMILIES[0]}")
        assert init["labels"] == b["labels"]
        meta = {i["key"]: i["value"] for i in b["metadata"]["items"]}
        assert meta["ssh-keys"] == f"cloudtrain:{req.public_key.strip()}"
        assert meta["enable-oslogin"] == "FALSE" and meta["install-nvidia-driver"] == "True"
        assert "serviceAccounts" not in b
        assert b["networkInterfaces"][0]["accessConfigs"][0]["type"] == "ONE_TO_ONE_NAT"
    # the boot disks exist with the same labels, and the nodes are what GCE reports
    disks = {d["name"]: d for d in gcp.fake.disks.values()}
    assert {d["labels"][L.CLUSTER] for d in disks.values()} == {"demo"}
    assert [n.rank for n in nodes] == [0, 1]
    for n in nodes:
        inst = next(i for i in gcp.fake.instances.values() if i["id"] == n.instance_id.split("/")[1])
        assert n.host == inst["networkInterfaces"][0]["accessConfigs"][0]["natIP"]
        assert n.internal_ip == inst["networkInterfaces"][0]["networkIP"]
        assert n.user == "cloudtrain" and n.status == "running" and not n.spot
    assert {b["_zone"] for b in bodies} == {"us-central1-a"}   # one zone for the cluster


def test_spot_on_accelerator_optimized_a2(gcp: Harness) -> None:
    _, nodes = gcp.up(gcp.request(accelerators="A100:8", use_spot=True, num_nodes=1))
    (b,) = gcp.fake.inserted_instances()
    assert b["machineType"].endswith("/machineTypes/a2-highgpu-8g")
    assert "guestAccelerators" not in b                    # the GPUs come with a2
    assert b["scheduling"] == {"onHostMaintenance": "TERMINATE", "provisioningModel": "SPOT",
                               "instanceTerminationAction": "DELETE", "automaticRestart": False}
    assert nodes[0].spot


def test_image_choice(gcp: Harness) -> None:
    # the newest Deep Learning VM family missing: the next one
    gcp.fake.remove_family(DLVM_PROJECT, DLVM_FAMILIES[0])
    gcp.up(gcp.request(name="a", num_nodes=1))
    assert gcp.fake.inserted_instances()[-1]["disks"][0]["initializeParams"]["sourceImage"] \
        .endswith(f"/images/family/{DLVM_FAMILIES[1]}")
    # an image path, a family of the image project, an image_family option
    gcp.fake.add_image("my-images", "trainer", "trainer-v3", disk_gb=40)
    cases = [("b", {"image": "projects/my-images/global/images/family/trainer"}, {},
              "projects/my-images/global/images/family/trainer"),
             ("c", {"image": "trainer"}, {"image_project": "my-images"},
              "projects/my-images/global/images/family/trainer"),
             ("d", {"image": "projects/my-images/global/images/trainer-v3"}, {},
              "projects/my-images/global/images/trainer-v3"),
             ("e", {}, {"image_family": DLVM_FAMILIES[2]},
              f"projects/{DLVM_PROJECT}/global/images/family/{DLVM_FAMILIES[2]}")]
    for name, res, opts, want in cases:
        gcp.up(gcp.request(name=name, num_nodes=1, gcp=opts, **res))
        assert gcp.fake.inserted_instances()[-1]["disks"][0]["initializeParams"][
            "sourceImage"] == want, name


def test_missing_image_or_small_disk_is_refused_before_any_instance(gcp: Harness) -> None:
    p = gcp.provider()
    with pytest.raises(UserError, match="no image"):
        gcp.up(gcp.request(image="projects/my-images/global/images/family/nope"), p)
    gcp.fake.add_image("my-images", "big", "big-v1", disk_gb=500)
    with pytest.raises(UserError, match="disk_size_gb 200 is smaller"):
        gcp.up(gcp.request(name="x", image="projects/my-images/global/images/family/big"))
    assert gcp.fake.instances == {}


def test_second_up_adopts_and_a_lost_rank_is_replaced_in_its_zone(gcp: Harness) -> None:
    p, first = gcp.up(gcp.request(num_nodes=3))
    inserts = len(gcp.fake.inserted_instances())
    _, again = gcp.up(gcp.request(num_nodes=3), p)
    assert again == first and len(gcp.fake.inserted_instances()) == inserts
    gcp.fake.preempt("us-central1-a", f"{_base()}-1")
    _, third = gcp.up(gcp.request(num_nodes=3))
    new = gcp.fake.inserted_instances()[inserts:]
    assert [(b["name"], b["_zone"]) for b in new] == [(f"{_base()}-1", "us-central1-a")]
    assert [n.rank for n in third] == [0, 1, 2]
    assert third[1].instance_id != first[1].instance_id and third[0] == first[0]


def test_a_stopped_node_is_started_not_replaced(gcp: Harness) -> None:
    p, first = gcp.up(gcp.request())
    gcp.fake.instances[("us-central1-a", f"{_base()}-0")]["status"] = "TERMINATED"
    _, again = gcp.up(gcp.request(), p)
    assert gcp.fake.calls("POST", r"/instances/[^/]+-0/start$")
    assert [n.instance_id for n in again] == [n.instance_id for n in first]
    assert {n.status for n in again} == {"running"}


def test_more_nodes_than_asked_is_refused(gcp: Harness) -> None:
    gcp.up(gcp.request(num_nodes=2))
    with pytest.raises(UserError, match="rank up to 1"):
        gcp.up(gcp.request(num_nodes=1))


def test_internal_addresses_and_other_options(gcp: Harness) -> None:
    _, nodes = gcp.up(gcp.request(num_nodes=1, gcp={
        "public_ip": False, "ssh_user": "trainer", "service_account": "sa@p.iam.gserviceaccount.com",
        "disk_type": "pd-ssd", "install_nvidia_driver": False}))
    (b,) = gcp.fake.inserted_instances()
    assert "accessConfigs" not in b["networkInterfaces"][0]
    assert nodes[0].host == nodes[0].internal_ip and nodes[0].host.startswith("10.128.")
    assert nodes[0].user == "trainer"
    assert b["serviceAccounts"][0]["email"] == "sa@p.iam.gserviceaccount.com"
    assert b["disks"][0]["initializeParams"]["diskType"].endswith("/diskTypes/pd-ssd")
    assert "install-nvidia-driver" not in {i["key"] for i in b["metadata"]["items"]}
    assert gcp.provider().list_nodes("demo")[0].user == "trainer"


def test_unknown_network_is_a_user_error_and_creates_nothing(gcp: Harness) -> None:
    with pytest.raises(UserError, match="network 'research' does not exist"):
        gcp.provider().ensure_network(gcp.request(gcp={"network": "research"}))
    assert gcp.fake.empty()


def test_check_refuses_bad_shapes_without_calling_gcp(gcp: Harness) -> None:
    p = gcp.provider()
    for kw, msg in [({"zone": "us-east1-b"}, "not in region us-central1"),
                    ({"zone": "useast1b"}, "not a GCP zone"),
                    ({"accelerators": "T4:3"}, "No offer fits"),
                    ({"gcp": {"credentials_file": "/nonexistent/key.json"}}, "does not exist")]:
        with pytest.raises(UserError, match=msg):
            p.check(gcp.request(**kw))
    assert gcp.fake.requests == []


def test_service_account_key_file_and_endpoint_from_the_environment(
        gcp: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gcp.fake.require_auth = True
    key = gcp.fake.service_account_key(tmp_path / "key.json")
    monkeypatch.setenv("CLOUDTRAIN_GCP_API_ENDPOINT", gcp.fake.url)
    p = gcp.provider(clients=None)
    # the project comes from the key file; every call is signed with its key
    _, nodes = gcp.up(gcp.request(num_nodes=1, gcp={"credentials_file": str(key)}), p)
    assert len(nodes) == 1
    assert {u["iss"] for u in gcp.fake.jwt_uses} == {
        "cloudtrain-test@test-project.iam.gserviceaccount.com"}
    assert not [h for h in gcp.fake.outside if "compute" in h]
    # down needs no task: the record says which key and project
    gcp.provider(clients=None).terminate("demo")
    assert gcp.fake.empty()


def test_application_default_credentials_and_project_from_the_task(
        gcp: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gcp.fake.require_auth = True
    key = gcp.fake.service_account_key(tmp_path / "key.json", project="some-other-project")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    monkeypatch.setenv("CLOUDTRAIN_GCP_API_ENDPOINT", gcp.fake.url)
    p = gcp.provider(clients=None)
    gcp.up(gcp.request(num_nodes=1, gcp={"project": "test-project"}), p)
    assert len(gcp.fake.instances) == 1
    saved = json.loads((gcp.home / "clusters" / "demo" / "gcp.json").read_text())
    assert saved["project"] == "test-project" and saved["zone"] == "us-central1-a"


def test_no_credentials_stops_with_the_fix_before_any_call(gcp: Harness,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDTRAIN_GCP_API_ENDPOINT", gcp.fake.url)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "test-project")
    with pytest.raises(AuthError) as e:
        gcp.provider(clients=None).ensure_network(gcp.request())
    assert "gcloud auth application-default login" in e.value.hint
    assert "GOOGLE_APPLICATION_CREDENTIALS" in e.value.hint
    assert gcp.fake.requests == []
    # and listing a cluster this machine never made is simply empty
    assert gcp.provider(clients=None).list_nodes("never") == []


def test_wrong_credentials_are_refused_as_auth_errors(gcp: Harness) -> None:
    gcp.fake.require_auth = True          # anonymous requests get 401
    with pytest.raises(AuthError) as e:
        gcp.provider().ensure_network(gcp.request())
    assert "credentials" in e.value.message
    assert "gcloud auth application-default login" in e.value.hint
    assert gcp.fake.empty()


def test_the_provider_module_and_plan_import_no_google(tmp_path: Path) -> None:
    code = ("import sys\n"
            "from cloudtrain.provider import ProviderContext, ClusterRequest\n"
            "from cloudtrain.spec import Resources\n"
            "from cloudtrain_provisioners.gcp import GCPProvider, GCPOptions\n"
            "from cloudtrain.pipeline.place import placed\n"
            "from pathlib import Path\n"
            f"p = GCPProvider(ProviderContext(Path({str(tmp_path)!r})), caller_ip=lambda: '1.2.3.4')\n"
            "r = ClusterRequest('demo', 2, Resources(provider='gcp', accelerators='T4:1'), "
            "GCPOptions(), '')\n"
            "p.check(r); p.plan(placed(p, r))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'google'))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
