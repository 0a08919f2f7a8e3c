"""Finding 10: the network a cluster's nodes sit on admits no more than cloudtrain's own rules
(SSH from the caller's range, the unauthenticated rendezvous/NCCL ports only between the
cluster's nodes).

GCP's ``default`` network comes with ``default-allow-ssh`` (tcp:22 from 0.0.0.0/0) and
``default-allow-internal`` (everything from 10.128.0.0/9), aimed at every instance; the GCE
fake models them. By default cloudtrain now gives each cluster a VPC network of its own and
deletes it at teardown; a network the user names is read first and refused (exit 2, nothing
created) when a rule there is wider than ours."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import CLI, processes_with

pytest.importorskip("google.cloud.compute_v1")

from cloudtrain_provisioners.gcp import tags as L  # noqa: E402
from cloudtrain_provisioners.gcp import network as NET  # noqa: E402
from gce_fake import TEST_CALLER_IP, GCEFake  # noqa: E402
from test_gcp_e2e import _entry_point_shim  # noqa: E402

WRITES = ("POST", "PATCH", "DELETE", "PUT")


@pytest.fixture
def gce(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The fake as the CLI meets it (service-account key it trusts, every request that is not
    for loopback refused by its proxy), and a CLI with its own home."""
    fake = GCEFake(require_auth=True, networks=("default", "research")).start()
    gcloud = tmp_path / "gcloud-config"
    gcloud.mkdir()
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(fake.service_account_key(tmp_path / "key.json")),
           "CLOUDTRAIN_GCP_API_ENDPOINT": fake.url, "NO_GCE_CHECK": "true",
           "CLOUDSDK_CONFIG": str(gcloud), "GOOGLE_CLOUD_PROJECT": "",
           "CLOUDSDK_CORE_PROJECT": "", "CLOUDTRAIN_GCP_PROJECT": "", "GCLOUD_PROJECT": "",
           "HTTPS_PROXY": fake.url, "HTTP_PROXY": fake.url, "https_proxy": fake.url,
           "http_proxy": fake.url, "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost"}
    shim = _entry_point_shim(tmp_path)
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH")) if p)
    home = tmp_path / "home"
    home.mkdir()
    yield CLI(home), env, fake
    fake.stop()
    for pid in processes_with(str(home)):
        os.kill(pid, 9)


def _task(tmp: Path, gcp: str) -> Path:
    f = tmp / "task.yaml"
    f.write_text("name: netsafe\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: gcp\n"
                 "  region: us-central1\n  accelerators: T4:1\n  ports: [6006]\n" + gcp)
    return f


def _writes(fake: GCEFake) -> list[str]:
    return [f"{r['method']} {r['path']}" for r in fake.requests if r["method"] in WRITES
            and not r["path"].endswith("/wait") and "/token" not in r["path"]]


def test_the_fake_default_network_carries_gces_default_rules() -> None:
    fake = GCEFake()
    rules = {n: f for n, f in fake.firewalls.items()}
    assert rules["default-allow-ssh"]["sourceRanges"] == ["0.0.0.0/0"]
    assert rules["default-allow-ssh"]["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert rules["default-allow-internal"]["sourceRanges"] == ["10.128.0.0/9"]
    assert {"default-allow-rdp", "default-allow-icmp"} <= set(rules)
    assert not any(f.get("targetTags") for f in rules.values())


@pytest.mark.parametrize("network", ["default", "research"])
def test_up_on_a_network_with_wider_rules_is_refused_before_anything_is_created(
        gce, tmp_path: Path, network: str) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake = gce
    if network == "research":
        # a user's network with one rule aimed at every instance: the NCCL/rendezvous ports
        # from the whole VPC range
        fake.firewalls["research-allow-vpc"] = {
            "name": "research-allow-vpc", "direction": "INGRESS", "priority": 1000,
            "network": f"https://www.googleapis.com/compute/v1/projects/{fake.project}/global/"
                       "networks/research",
            "allowed": [{"IPProtocol": "tcp", "ports": ["29500-29600"]}],
            "sourceRanges": ["10.0.0.0/8"]}
        rule = "research-allow-vpc"
    else:
        rule = "default-allow-ssh"
    task = _task(tmp_path, f"  ssh_cidr: {TEST_CALLER_IP}/32\n  gcp:\n    network: {network}\n")
    before = dict(fake.firewalls)
    r = cli.run("up", str(task), **env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out
    assert f"{rule} admits" in out and "resources.gcp.network" in out
    if network == "default":
        assert "default-allow-internal admits" in out
    assert "Leave resources.gcp.network out" in out
    # nothing was created, patched or deleted in the project, and no local trace is left
    assert _writes(fake) == [], _writes(fake)
    assert fake.empty(), fake.ours()
    assert fake.firewalls == before
    assert cli.status() == []


def test_up_on_a_named_network_whose_rules_are_no_wider_passes_the_audit() -> None:
    base = L.base_name("netsafe", "alice@example")
    net = "projects/p/global/networks/research"
    narrow = [
        # SSH from inside the caller's range, to every instance
        {"name": "ssh-office", "network": net, "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}],
         "sourceRanges": ["198.51.100.0/25"]},
        # wide, but aimed at other instances only
        {"name": "web", "network": net, "allowed": [{"IPProtocol": "tcp", "ports": ["80"]}],
         "sourceRanges": ["0.0.0.0/0"], "targetTags": ["web"]},
        # wide, but disabled; a deny rule; another network's rule
        {"name": "off", "network": net, "allowed": [{"IPProtocol": "all"}],
         "sourceRanges": ["0.0.0.0/0"], "disabled": True},
        {"name": "deny", "network": net, "denied": [{"IPProtocol": "all"}],
         "sourceRanges": ["0.0.0.0/0"]},
        {"name": "elsewhere", "network": "projects/p/global/networks/other",
         "allowed": [{"IPProtocol": "all"}], "sourceRanges": ["0.0.0.0/0"]},
    ]
    assert NET.wider_rules(narrow, "research", base, "198.51.100.0/24", [6006], None) == []
    wide = [
        {"name": "all-from-tagged", "network": net, "allowed": [{"IPProtocol": "all"}],
         "sourceTags": ["bastion"]},
        {"name": "ssh-world-to-us", "network": net,
         "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}], "sourceRanges": ["0.0.0.0/0"],
         "targetTags": [base]},
        {"name": "sa-target", "network": net, "allowed": [{"IPProtocol": "udp"}],
         "sourceRanges": ["198.51.100.7/32"], "targetServiceAccounts": ["n@p.iam"]},
    ]
    found = NET.wider_rules(wide, "research", base, "198.51.100.0/24", [6006], "n@p.iam")
    assert [f["name"] for f, _ in found] == ["all-from-tagged", "ssh-world-to-us", "sa-target"]


def test_dedicated_network_is_created_used_and_deleted(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``up`` without a network makes the cluster's own (auto-mode, marked); the nodes and
    rules use it, the default network's rules reach none of them, and teardown deletes it
    and checks that it is gone. (Through the CLI: test_gcp_e2e's launch --down.)"""
    from gce_fake import Harness, hermetic_env

    hermetic_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake() as fake:
        fake.guard_env(monkeypatch)
        h = Harness(fake, tmp_path / "home")
        p, _nodes = h.up(h.request(name="netsafe"))
        base = L.base_name("netsafe", "alice@laptop.example")
        res = fake.network_res[f"{base}-net"]
        assert res["autoCreateSubnetworks"] is True
        assert L.marks(res["description"])[L.CLUSTER] == "netsafe"
        assert fake.instances
        for inst in fake.instances.values():
            assert inst["networkInterfaces"][0]["network"].endswith(f"/networks/{base}-net")
        on_ours = [f for f in fake.firewalls.values() if f["network"].endswith(f"/{base}-net")]
        assert sorted(f["name"] for f in on_ours) == [f"{base}-internal", f"{base}-ssh"]
        assert NET.wider_rules(list(fake.firewalls.values()), f"{base}-net", base,
                               f"{TEST_CALLER_IP}/32", [], None) == []
        p.terminate("netsafe")
        assert f"{base}-net" not in fake.network_res
        assert fake.empty(), fake.ours()
        assert "default" in fake.network_res      # the project's own network is untouched


# --- AWS and Azure: their defaults checked the same way ----------------------------------------

def test_aws_nodes_carry_only_the_clusters_security_group(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default VPC's default security group (all traffic between its members) is never
    attached: each node's only group is the cluster's, whose rules are SSH from the caller's
    /32 and everything from the group itself."""
    pytest.importorskip("moto")
    from moto import mock_aws

    from aws_moto import (TEST_CALLER_IP as AWS_IP, Harness,
                                                     add_images_to_moto)
    from aws_moto import hermetic_env as aws_env

    aws_env(monkeypatch)
    with mock_aws():
        add_images_to_moto("us-east-1")
        h = Harness(tmp_path / "home")
        p = h.provider()
        req = h.request()
        p.create_nodes(req, p.ensure_network(req))
        raw = h.clients.raw("us-east-1")
        insts = [i for r in raw.describe_instances()["Reservations"] for i in r["Instances"]]
        assert len(insts) == 2
        [ours] = h.tagged()["security_groups"]
        for i in insts:
            groups = [g for nic in i["NetworkInterfaces"] for g in nic["Groups"]]
            groups += i.get("SecurityGroups") or []
            assert {g["GroupId"] for g in groups} == {ours["GroupId"]}, groups
            assert all(g["GroupName"] != "default" for g in groups)
        sources = sorted(
            (perm.get("FromPort"), rng["CidrIp"]) for perm in ours["IpPermissions"]
            for rng in perm.get("IpRanges", []))
        assert sources == [(22, f"{AWS_IP}/32")]
        assert [pair["GroupId"] for perm in ours["IpPermissions"]
                for pair in perm.get("UserIdGroupPairs", [])] == [ours["GroupId"]]


def test_azure_nsg_denies_before_azures_default_rules() -> None:
    """Azure puts AllowVnetInBound (65000: the VNet, peered networks, gateways) and
    AllowAzureLoadBalancerInBound (65001) under every NSG. cloudtrain's NSG allows only SSH
    and the task's ports from the caller's range and the cluster's own VNet range, then denies
    everything at 4096, before those defaults are reached."""
    from cloudtrain_provisioners.azure import network as AZNET

    rules = AZNET.desired_rules("198.51.100.7/32", [6006], "10.42.0.0/16")
    deny = [r for r in rules if r.access == "Deny"]
    assert [(d.source, d.port, d.priority) for d in deny] == [("*", "*", AZNET.PRIORITY_DENY)]
    assert AZNET.PRIORITY_DENY < 65000
    for r in rules:
        if r.access == "Allow":
            assert r.priority < AZNET.PRIORITY_DENY
            assert r.source in ("198.51.100.7/32", "10.42.0.0/16"), r
            assert r.source not in ("*", "VirtualNetwork", "Internet", "0.0.0.0/0")


def test_a_cluster_made_on_a_shared_network_is_not_silently_moved(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cluster whose nodes are on a named (or, before this change, the default) network:
    an ``up`` without resources.gcp.network would put the rules on a new network its nodes
    are not on. It stops instead (exit 2), saying how to go on."""
    from cloudtrain.errors import UserError

    from gce_fake import Harness, hermetic_env

    hermetic_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake(networks=("default", "research")) as fake:
        fake.guard_env(monkeypatch)
        h = Harness(fake, tmp_path / "home")
        h.up(h.request(name="old", gcp={"network": "research"}))
        with pytest.raises(UserError, match="was created on network 'research'") as exc:
            h.provider().ensure_network(h.request(name="old"))
        assert exc.value.exit_code == 2 and "resources.gcp.network: research" in exc.value.hint
        assert not [n for n in fake.network_res if n.startswith("ct-")]
