"""End to end through the real CLI on GCP: ``cloudtrain launch --down`` of a 2-node x 2-process
DDP job, with the Compute Engine REST fake as the cloud (reached through
CLOUDTRAIN_GCP_API_ENDPOINT, authenticated with a service-account key file it trusts) and two
local sshd nodes standing in for the instances.

The fake hands out fixed external addresses and, as internal ones, the local nodes' own
(tests/fakes/standin.py); the tasks reach the nodes through ``resources.ssh_proxy``, a relay
that maps exactly the external addresses to the local nodes, so nothing ever connects to an
address the fake made up. The fake plays the guest agent too: when an instance runs, the SSH
key from its ``ssh-keys`` metadata is authorised on the node its address maps to, and the
node is bound to its instance (its guest shutdown tells the fake). Every HTTP(S) request
that is not for loopback goes to the fake's proxy, which records and refuses it."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from conftest import CLI, DEMO, needs_sshd, needs_torch, processes_with, wait_until

pytest.importorskip("google.cloud.compute_v1")

from gce_fake import GCEFake  # noqa: E402

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

NAT = ["34.9.0.10", "34.9.0.11"]


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class Nodes:
    """Two local sshd nodes on their own loopback addresses, standing in for the instances
    (tests/fakes/standin.py); ``proxy_map`` maps the fake's external addresses to them."""

    def __init__(self, root: Path, count: int = 2) -> None:
        import standin
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
        self.user = getpass.getuser()
        self.proxy_map = root / "proxy-map.json"
        for r in range(count):
            d = root / f"node{r}"
            (d / "root").mkdir(parents=True)
            addr = f"{net}.{10 + r}"
            port = _free_port(addr)
            self.host_keys.append(sshd.write_host_key(d / "ssh_host_ed25519_key"))
            (d / "authorized_keys").write_text("")
            standin.prepare(d, address=addr, port=port, user=self.user, marker=self.marker)
            standin.start(d)
            self.dirs.append(d)
            self.addrs.append((addr, port))
        self.master_port = _free_port(self.addrs[0][0])

    @property
    def internal(self) -> list[str]:
        """The addresses the fake gives as the instances' internal ones: the nodes' own."""
        return [a for a, _ in self.addrs]

    def map(self, nat: list[str]) -> None:
        """``nat[r]`` (an address the fake invents) reaches node ``r`` through the proxy."""
        import standin

        standin.ProxyMap(self.proxy_map).add(
            {**dict(zip(nat, self.addrs)), **{a: (a, p) for a, p in self.addrs}})

    def bind(self, rank: int, fake_url: str, name: str) -> None:
        """Node ``rank`` is instance ``name`` of the GCE fake at ``fake_url``."""
        import standin

        standin.bind(self.dirs[rank], "gce", "--url", fake_url, "--name", name)

    def use(self, task: Path) -> Path:
        """``task`` with the stand-ins' ssh_proxy, the login user and the rendezvous port."""
        import standin

        return standin.use_proxy(task, self.proxy_map, "gcp", self.user,
                                 master_port=self.master_port)

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
    nodes = Nodes(tmp_path / "nodes")
    fake = GCEFake(require_auth=True, nat_ips=list(NAT), internal_ips=nodes.internal).start()
    # the guest agent: authorise the instance's metadata key on the node its address maps to,
    # and publish that node's host key in the instance's guest attributes
    authorized: list[str] = []

    def guest_agent(inst: dict) -> None:  # type: ignore[type-arg]
        nat = inst["networkInterfaces"][0]["accessConfigs"][0]["natIP"]
        nodes.bind(NAT.index(nat), fake.url, inst["name"])
        fake.publish_host_keys(inst, nodes.publish_instead or [nodes.host_keys[NAT.index(nat)]])
        for item in inst["metadata"]["items"]:
            if item["key"] == "ssh-keys":
                user, _, key = item["value"].partition(":")
                nodes.authorize(NAT.index(nat), key)
                authorized.append(f"{nat} {user}")
    fake.on_running.append(guest_agent)

    nodes.map(NAT)
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
    nodes.use(task)

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
