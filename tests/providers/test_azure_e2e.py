"""The Azure provider through the real command line: ``cloudtrain launch --down`` of a 2-node
training job against the ARM fake (HTTPS on loopback, reached through
CLOUDTRAIN_AZURE_ARM_ENDPOINT and CLOUDTRAIN_AZURE_CA_BUNDLE), whose VMs are two local sshd
nodes (tests/fakes/standin.py): the fake gives the nodes' own addresses as the VMs' private
ones, and the task reaches the VMs' public addresses through ``resources.ssh_proxy``, a relay
that maps them to the nodes.

The fake plays cloud-init: when a VM's creation succeeds, its node accepts the SSH key the
VM was created with, the proxy map gets the VM's public address, the node learns its VM's
identity endpoint (AZURE_POD_IDENTITY_AUTHORITY_HOST, the fake's IMDS path of that VM, and
REQUESTS_CA_BUNDLE, the fake's CA) and is bound to its VM (its guest shutdown tells the fake). The cloudtrain process runs under
a guard (a sitecustomize on PYTHONPATH) that refuses and records every connection to a
non-loopback address, and ``ssh`` is a shim that records where it connects: no address the
fake invented is ever used, and no real Azure endpoint is ever asked for anything."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import DEMO, needs_sshd, needs_torch

pytest.importorskip("azure.mgmt.compute")

import standin  # noqa: E402
from arm_fake import SUBSCRIPTION, ArmFake  # noqa: E402

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

# Refuses (and logs) any IPv4/IPv6 connection that is not to loopback, in every process that
# imports site (cloudtrain, and what it runs locally).
NET_GUARD = """
import ipaddress as _ip, os as _os, socket as _socket

def _loopback(sock, address):
    if sock.family not in (_socket.AF_INET, _socket.AF_INET6):
        return True
    try:
        return _ip.ip_address(address[0]).is_loopback
    except ValueError:
        return False

def _wrap(real):
    def guarded(self, address):
        if not _loopback(self, address):
            with open(_os.environ["CT_AZ_GUARD_LOG"], "a") as log:
                log.write("%d %r\\n" % (_os.getpid(), address))
            raise ConnectionRefusedError(111, "test guard: not loopback: %r" % (address,))
        return real(self, address)
    return guarded

_socket.socket.connect = _wrap(_socket.socket.connect)
_socket.socket.connect_ex = _wrap(_socket.socket.connect_ex)
"""

SSH_RECORDER = """#!/bin/sh
printf '%s\\n' "$*" >> "$CT_AZ_SSH_LOG"
exec {ssh} "$@"
"""

TASK = """
name: azdemo
num_nodes: 2
resources:
  provider: azure
  region: eastus
  instance_type: Standard_NC4as_T4_v3
  ssh_cidr: 127.0.0.1/32
  ports: [6006]
workdir: .
train:
  script: ddp_demo.py
  args: [--steps, "10", --out, outputs]
  nproc_per_node: 2
  rendezvous: static
outputs: [outputs/]
"""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Nodes:
    """Two sshd nodes on loopback addresses standing in for the VMs (tests/fakes/standin.py).
    They accept no key until the fake "boots" their VM."""

    def __init__(self, base: Path, n: int = 2) -> None:
        from cloudtrain_provisioners.local import sshd

        self.sshd = sshd
        self.user = standin.login_user("azure")
        self.proxy_map = base / "proxy-map.json"
        h = int(hashlib.sha256(f"azure:{base}".encode()).hexdigest()[:6], 16)
        prefix = f"127.{64 + h % 128}.{(h >> 8) % 256}"
        self.marker = f"ctaz-{h:06x}"
        self.nodes: list[dict[str, Any]] = []
        for r in range(n):
            d = base / f"vm{r}"
            (d / "root").mkdir(parents=True)
            addr = f"{prefix}.{20 + r}"
            port = _free_port(addr)
            sshd.write_host_key(d / "ssh_host_ed25519_key")
            (d / "authorized_keys").write_text("")
            standin.prepare(d, address=addr, port=port, user=self.user, marker=self.marker)
            self.nodes.append({"dir": d, "address": addr, "port": port})
        self.master_port = _free_port(self.nodes[0]["address"])

    def private_address(self, nic: str) -> str:
        """The ARM fake's hook: a VM's NIC (``<cluster>-<rank>-nic``) gets its node's address."""
        return str(self.nodes[int(nic.rsplit("-", 2)[1])]["address"])

    def use(self, task: Path) -> Path:
        """``task`` with the stand-ins' ssh_proxy, login user and rendezvous port."""
        return standin.use_proxy(task, self.proxy_map, "azure", self.user,
                                 master_port=self.master_port)

    def start(self) -> None:
        for n in self.nodes:
            standin.start(n["dir"])

    def stop(self) -> None:
        for n in self.nodes:
            self.sshd.stop(n["dir"])
        self.sshd.kill_marked(self.marker)


def _restart_sshd(sshd: Any, d: Path) -> None:
    """Stop a node's sshd, wait until it is gone, start it again (it reads its host key)."""
    pid = sshd.pid(d)
    sshd.stop(d)
    deadline = time.monotonic() + 10
    while pid is not None and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    standin.start(d)


class Booter:
    """The fake's hook when a VM's creation succeeds: what cloud-init, Azure's metadata
    service and the test's proxy map do for it."""

    def __init__(self, nodes: Nodes, fake: ArmFake) -> None:
        self.nodes = nodes
        self.fake = fake
        fake.private_address = nodes.private_address
        self.addresses: dict[str, tuple[str, int]] = {}
        """Public address (the fake's) -> the node it reaches, through the proxy."""
        self.keys: list[str] = []
        self.host_keys: dict[int, str] = {}
        # a node that keeps the host key it had instead of the injected one (tests of a node
        # presenting another key than the one cloudtrain pinned)
        self.keep_own_host_key = False

    def _host_key(self, d: Path, rank: int, custom_data: str | None) -> None:
        """cloud-init's cc_ssh: install the host key pair the user data carries."""
        from cloudtrain.keys import host_key_from_cloud_config

        if not custom_data or self.keep_own_host_key:
            return
        pair = host_key_from_cloud_config(base64.b64decode(custom_data).decode())
        if pair is None:
            return
        priv, pub = pair
        fd = os.open(d / "ssh_host_ed25519_key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(priv)
        (d / "ssh_host_ed25519_key.pub").write_text(pub + "\n")
        self.host_keys[rank] = pub
        _restart_sshd(self.nodes.sshd, d)

    def __call__(self, vm: dict[str, Any], public: str, private: str) -> None:
        rank = int(vm["tags"]["cloudtrain:node-rank"])
        node = self.nodes.nodes[rank]
        assert private == node["address"], (private, node["address"])
        self.boot(node, rank, vm, public, private)

    def boot(self, node: dict[str, Any], rank: int, vm: dict[str, Any], public: str,
             private: str) -> None:
        """VM ``vm`` (of ``rank``) boots on the local ``node``."""
        lin = vm["properties"]["osProfile"]["linuxConfiguration"]
        keys = [k["keyData"] for k in lin["ssh"]["publicKeys"]]
        self.keys += keys
        (node["dir"] / "authorized_keys").write_text("\n".join(keys) + "\n")
        imds = self.fake.imds_of(vm["id"].split("/")[4], vm["name"])
        standin.set_env(node["dir"], {"AZURE_POD_IDENTITY_AUTHORITY_HOST": imds,
                                      "REQUESTS_CA_BUNDLE": str(self.fake.cert_file)})
        standin.bind(node["dir"], "azure", "--url", imds)
        self._host_key(node["dir"], rank, vm["properties"]["osProfile"].get("customData"))
        self.addresses[public] = (node["address"], node["port"])
        standin.ProxyMap(self.nodes.proxy_map).add(
            {public: self.addresses[public], private: self.addresses[public]})


def cli_env(tmp_path: Path, fake: ArmFake, dist_name: str) -> dict[str, str]:
    """The environment of a CLI run against the ARM fake: the network guard (a sitecustomize)
    and the provider's entry point on PYTHONPATH, the fake's endpoint, CA and token, and
    nothing of the caller's Azure or cloudtrain settings."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NET_GUARD)
    # The provider's entry point, as 'pip install cloudtrain[azure]' registers it (whether or
    # not this checkout's editable install was made after pyproject.toml gained it).
    dist = guard / f"{dist_name}-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name.replace('_', '-')}\n"
                                   "Version: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[cloudtrain.providers]\nazure = cloudtrain_provisioners.azure:AzureProvider\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AZURE_", "CLOUDTRAIN_", "MSI_", "IDENTITY_"))}
    env.update({
        "CLOUDTRAIN_HOME": str(tmp_path / "home"), "NO_COLOR": "1",
        "CLOUDTRAIN_SSH_TIMEOUT": "60", "CLOUDTRAIN_AUTO_PREFLIGHT": "0",   # tests/conftest.py
        "CLOUDTRAIN_AZURE_ARM_ENDPOINT": fake.url,
        "CLOUDTRAIN_AZURE_CA_BUNDLE": str(fake.cert_file),
        "CLOUDTRAIN_AZURE_ACCESS_TOKEN": fake.token,
        "CLOUDTRAIN_AZURE_POLL_INTERVAL": "0",
        "AZURE_SUBSCRIPTION_ID": SUBSCRIPTION,
        "AZURE_CONFIG_DIR": str(tmp_path / "no-azure-cli"),
        "PYTHONPATH": os.pathsep.join([str(guard), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "CT_AZ_GUARD_LOG": str(tmp_path / "guard.log"),
        "CT_AZ_SSH_LOG": str(tmp_path / "ssh.log"),
    })
    return env


@pytest.fixture
def world(tmp_path: Path):  # type: ignore[no-untyped-def]
    fake = ArmFake(tmp_path / "arm").start()
    nodes = Nodes(tmp_path / "vms")
    booter = Booter(nodes, fake)
    fake.on_vm_running = booter
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "ssh").write_text(SSH_RECORDER.format(ssh=shutil.which("ssh") or "/usr/bin/ssh"))
    (shim / "ssh").chmod(0o755)
    env = cli_env(tmp_path, fake, "cloudtrain_azure_e2e")
    env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
    nodes.start()
    try:
        yield fake, nodes, booter, env
    finally:
        nodes.stop()
        fake.stop()


def _cloudtrain(env: dict[str, str], *args: str, timeout: float = 120
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_launch_down_two_nodes_through_the_cli(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake, nodes, booter, env = world
    proj = tmp_path / "proj"
    shutil.copytree(DEMO, proj, ignore=shutil.ignore_patterns("cloudtrain-outputs", "__pycache__"))
    task = proj / "task-azure.yaml"
    task.write_text(TASK)
    nodes.use(task)

    r = _cloudtrain(env, "launch", str(task), "--down", "-y", timeout=400)
    out = r.stderr + r.stdout
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    assert "Provisioning 2 node(s) on azure" in out

    result = json.loads((proj / "cloudtrain-outputs" / "outputs" / "result.json").read_text())
    assert result["world_size"] == 4 and result["num_nodes"] == 2
    assert result["allreduce_sum"] == 6.0 and result["replicas_in_sync"] is True

    # What was made, and how: two VMs in one zone, the NSG of the task, the cluster's key.
    puts = fake.ops_of("PUT", "virtualmachines")
    assert sorted(p.name for p in puts) == ["azdemo-0", "azdemo-1"] and {p.zone for p in puts} == {"1"}
    (nsg_put,) = fake.ops_of("PUT", "networksecuritygroups")
    rules = {(x["name"], x["properties"]["sourceAddressPrefix"], x["properties"]["destinationPortRange"])
             for x in nsg_put.body["properties"]["securityRules"]}
    assert ("ct-ssh", "127.0.0.1/32", "22") in rules and ("ct-port-6006", "127.0.0.1/32", "6006") in rules
    assert len(set(booter.keys)) == 1 and booter.keys[0].startswith("ssh-ed25519 ")

    # The fake holds nothing any more, and the state forgot the cluster.
    assert fake.everything() == []
    assert len(fake.ops_of("DELETE", "resourcegroups")) == 1
    assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []

    # No connection left loopback; ssh reached the fake's addresses only through the proxy,
    # which connected only to the stand-ins on loopback.
    guard_log = tmp_path / "guard.log"
    assert not guard_log.exists() or guard_log.read_text() == ""
    ssh_log = Path(env["CT_AZ_SSH_LOG"]).read_text()
    assert ssh_log, "rsync went through ssh"
    assert booter.addresses
    relays = standin.ProxyMap(nodes.proxy_map)
    assert relays.relayed and relays.only_loopback(), relays.relayed
    assert {a.rsplit(":", 1)[0] for a, _ in relays.relayed} <= set(booter.addresses) | {
        n["address"] for n in nodes.nodes}
    for address in booter.addresses:
        assert address not in out
