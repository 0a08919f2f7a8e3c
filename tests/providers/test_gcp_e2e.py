"""End to end through the real CLI on GCP: ``cloudtrain launch --down`` of a 2-node x 2-process
DDP job, with the Compute Engine REST fake as the cloud (reached through
CLOUDTRAIN_GCP_API_ENDPOINT, authenticated with a service-account key file it trusts) and two
local sshd nodes standing in for the instances.

The fake hands out fixed external and internal addresses; CLOUDTRAIN_GCP_ADDRESS_MAP maps
exactly those to the local nodes, so cloudtrain never connects to an address the fake made
up. The fake plays the guest agent too: when an instance runs, the SSH key from its
``ssh-keys`` metadata is authorised on the node its address maps to. Every HTTP(S) request
that is not for loopback goes to the fake's proxy, which records and refuses it."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import sys
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from conftest import CLI, DEMO, needs_sshd, needs_torch, processes_with, wait_until

pytest.importorskip("google.cloud.compute_v1")

from gce_fake import GCEFake  # noqa: E402

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

NAT = ["34.9.0.10", "34.9.0.11"]
INTERNAL = ["10.128.0.10", "10.128.0.11"]


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class Nodes:
    """Two local sshd nodes on their own loopback addresses."""

    def __init__(self, root: Path, count: int = 2) -> None:
        from cloudtrain_provisioners.local import sshd

        self.sshd = sshd
        self.marker = f"gcp-e2e-{uuid.uuid4().hex[:8]}"
        net = f"127.{90 + os.getpid() % 100}.{os.getpid() // 100 % 250}"
        self.dirs: list[Path] = []
        self.addrs: list[tuple[str, int]] = []
        self.host_keys: list[str] = []
        # what the guest agent publishes instead of the node's real host key (tests of a
        # node that presents another key than the one published)
        self.publish_instead: list[str] | None = None
        for r in range(count):
            d = root / f"node{r}"
            (d / "root").mkdir(parents=True)
            addr = f"{net}.{10 + r}"
            port = _free_port(addr)
            self.host_keys.append(sshd.write_host_key(d / "ssh_host_ed25519_key"))
            (d / "authorized_keys").write_text("")
            sshd.write_config(d, address=addr, port=port, user=getpass.getuser(),
                              marker=self.marker, home=d / "root")
            sshd.start(d)
            self.dirs.append(d)
            self.addrs.append((addr, port))

    def authorize(self, rank: int, key_line: str) -> None:
        with open(self.dirs[rank] / "authorized_keys", "a") as f:
            f.write(key_line.strip() + "\n")

    def stop(self) -> None:
        for d in self.dirs:
            self.sshd.stop(d)
        self.sshd.kill_marked(self.marker)


def _entry_point_shim(tmp: Path) -> str | None:
    """A folder to put on PYTHONPATH that registers the gcp entry point, when the installed
    distribution does not carry it yet (pyproject.toml gains the line with the provider)."""
    if any(ep.name == "gcp" for ep in entry_points(group="cloudtrain.providers")):
        return None
    d = tmp / "ep" / "cloudtrain_gcp_e2e-0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: cloudtrain-gcp-e2e\nVersion: 0\n")
    (d / "entry_points.txt").write_text(
        "[cloudtrain.providers]\ngcp = cloudtrain_provisioners.gcp:GCPProvider\n")
    return str(tmp / "ep")


@pytest.fixture
def world(tmp_path: Path):  # type: ignore[no-untyped-def]
    fake = GCEFake(require_auth=True, nat_ips=list(NAT), internal_ips=list(INTERNAL)).start()
    nodes = Nodes(tmp_path / "nodes")
    # the guest agent: authorise the instance's metadata key on the node its address maps to,
    # and publish that node's host key in the instance's guest attributes
    authorized: list[str] = []

    def guest_agent(inst: dict) -> None:  # type: ignore[type-arg]
        nat = inst["networkInterfaces"][0]["accessConfigs"][0]["natIP"]
        fake.publish_host_keys(inst, nodes.publish_instead or [nodes.host_keys[NAT.index(nat)]])
        for item in inst["metadata"]["items"]:
            if item["key"] == "ssh-keys":
                user, _, key = item["value"].partition(":")
                nodes.authorize(NAT.index(nat), key)
                authorized.append(f"{nat} {user}")
    fake.on_running.append(guest_agent)

    amap = tmp_path / "address-map.json"
    amap.write_text(json.dumps({
        "addresses": {**{NAT[r]: {"host": a, "port": p, "root_dir": str(nodes.dirs[r] / "root")}
                         for r, (a, p) in enumerate(nodes.addrs)},
                      **{INTERNAL[r]: {"host": a} for r, (a, _) in enumerate(nodes.addrs)}},
        "user": getpass.getuser(), "python": sys.executable,
        "master_port": _free_port(nodes.addrs[0][0])}))
    gcloud = tmp_path / "gcloud-config"
    gcloud.mkdir()
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(fake.service_account_key(tmp_path / "key.json")),
           "CLOUDTRAIN_GCP_API_ENDPOINT": fake.url, "CLOUDTRAIN_GCP_ADDRESS_MAP": str(amap),
           "CLOUDTRAIN_GCP_ADDRESS_MAP_WAIT": "10", "NO_GCE_CHECK": "true",
           "CLOUDSDK_CONFIG": str(gcloud), "GOOGLE_CLOUD_PROJECT": "",
           "CLOUDSDK_CORE_PROJECT": "", "CLOUDTRAIN_GCP_PROJECT": "", "GCLOUD_PROJECT": "",
           "HTTPS_PROXY": fake.url, "HTTP_PROXY": fake.url, "https_proxy": fake.url,
           "http_proxy": fake.url, "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost"}
    shim = _entry_point_shim(tmp_path)
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH"))
                                            if p)
    home = tmp_path / "home"
    home.mkdir()
    cli = CLI(home)
    yield cli, env, fake, nodes, authorized
    # whatever happened: take down what the fake still holds, through the same endpoint
    cli.run("down", "-a", "-y", timeout=120, **env)
    nodes.stop()
    fake.stop()
    for pid in processes_with(str(home)):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_launch_down_on_gcp_through_the_cli(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake, nodes, authorized = world
    proj = tmp_path / "proj"
    shutil.copytree(DEMO, proj, ignore=shutil.ignore_patterns("cloudtrain-outputs", "__pycache__"))
    task = proj / "task-gcp.yaml"
    task.write_text(
        "name: gcp-demo\nnum_nodes: 2\n"
        "resources:\n  provider: gcp\n  region: us-central1\n  accelerators: T4:1\n"
        "  ssh_cidr: 198.51.100.7/32\n  ports: [6006]\n"
        "workdir: .\nenvs:\n  OMP_NUM_THREADS: '1'\n"
        "train:\n  script: ddp_demo.py\n  args: [--steps, '10', --out, outputs]\n"
        "  nproc_per_node: 2\n  rendezvous: static\n"
        "outputs: [outputs/]\n")

    r = cli.run("launch", str(task), "--down", "-y", timeout=420, **env)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]

    # the job ran on both "instances", all four ranks together
    res = json.loads((proj / "cloudtrain-outputs" / "outputs" / "result.json").read_text())
    assert res["world_size"] == 4 and res["allreduce_sum"] == 6.0 and res["num_nodes"] == 2
    assert "(node-0)" in r.stdout and "(node-1)" in r.stdout

    # GCE saw the real thing: two labelled T4 instances in one zone, the rules, a signed caller
    bodies = fake.inserted_instances()
    assert len(bodies) == 2 and {b["_zone"] for b in bodies} == {"us-central1-a"}
    assert {b["labels"]["cloudtrain-cluster"] for b in bodies} == {"gcp-demo"}
    assert all(b["guestAccelerators"][0]["acceleratorType"].endswith("/nvidia-tesla-t4")
               for b in bodies)
    rules = [c["body"] for c in fake.calls("POST", "/global/firewalls$")]
    ssh = next(b for b in rules if b["name"].endswith("-ssh"))
    assert ssh["sourceRanges"] == ["198.51.100.7/32"]
    assert sorted(a.split()[0] for a in authorized) == sorted(NAT)
    assert {u["iss"] for u in fake.jwt_uses} == {
        "cloudtrain-test@test-project.iam.gserviceaccount.com"}

    # --down: the fake holds nothing of cloudtrain's, and the CLI knows no cluster
    assert fake.empty(), fake.ours()
    assert fake.instances == {} and fake.disks == {}
    assert cli.run("status", "--json", **env).stdout.strip() == "[]"
    assert wait_until(lambda: not processes_with(str(cli.home)), 10)

    # nothing tried to leave loopback except google-auth's own regional-access-boundary
    # lookup (refused by the fake's proxy)
    assert all(h.startswith("iamcredentials.googleapis.com") for h in fake.outside), fake.outside
    assert fake.unhandled == []
