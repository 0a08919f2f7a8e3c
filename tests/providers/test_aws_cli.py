"""The AWS provider through the real command line: ``up --dry-run`` (prints the plan, calls
nothing), and ``launch --down`` of a 2-node job against a moto server on loopback whose
instances are local sshd nodes (tests/fakes/standin.py), reached through the task's
``resources.ssh_proxy`` (the tests' relay, which maps moto's public addresses to the nodes).

Every cloudtrain process here runs under a guard (a sitecustomize on PYTHONPATH) that refuses
and records any connection to a non-loopback address, and with an ``ssh`` on PATH that records
every ssh call: the test checks that nothing connected to an address moto invented (the relay
connected only to the nodes on loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DEMO, needs_sshd, needs_torch
from loopback_guard import GUARD

FAKES = Path(__file__).resolve().parents[1] / "fakes"

pytest.importorskip("moto")
boto3 = pytest.importorskip("boto3")

from cloudtrain.catalog.load import load_catalog  # noqa: E402


SSH_SHIM = """#!/bin/sh
echo "$@" >> "$CT_TEST_SSH_LOG"
exec {ssh} "$@"
"""

TASK = """
name: {name}
num_nodes: 2
resources:
  provider: aws
{region}  instance_type: g4dn.xlarge
  ssh_cidr: 127.0.0.1/32
  ports: [6006]
  aws: {{host_key_wait: 0}}
workdir: .
train:
  script: ddp_demo.py
  args: [--steps, "30", --out, outputs]
  nproc_per_node: 2
  rendezvous: static
outputs: [outputs/]
"""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def guarded(tmp_path: Path) -> dict[str, str]:
    """Environment for a cloudtrain process: its own home, no AWS profile of the user, the
    connection guard and the ssh recorder."""
    import shutil

    gdir = tmp_path / "guard"
    gdir.mkdir()
    (gdir / "sitecustomize.py").write_text(GUARD)
    shim = tmp_path / "shim"
    shim.mkdir()
    real_ssh = shutil.which("ssh") or "/usr/bin/ssh"
    (shim / "ssh").write_text(SSH_SHIM.format(ssh=real_ssh))
    (shim / "ssh").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CLOUDTRAIN_"))}
    env.update({
        "CLOUDTRAIN_HOME": str(tmp_path / "home"), "NO_COLOR": "1",
        "CLOUDTRAIN_SSH_TIMEOUT": "60", "CLOUDTRAIN_AUTO_PREFLIGHT": "0",   # tests/conftest.py
        "PYTHONPATH": os.pathsep.join([str(gdir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PATH": f"{shim}{os.pathsep}{env.get('PATH', '')}",
        "CT_TEST_GUARD_LOG": str(tmp_path / "guard.log"),
        "CT_TEST_SSH_LOG": str(tmp_path / "ssh.log"),
        "AWS_CONFIG_FILE": "/nonexistent/aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
        "AWS_EC2_METADATA_DISABLED": "true",
    })
    return env


def _cloudtrain(env: dict[str, str], *args: str, cwd: Path | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)


def _guard_log(env: dict[str, str]) -> str:
    p = Path(env["CT_TEST_GUARD_LOG"])
    return p.read_text() if p.exists() else ""


def test_the_guard_is_active_in_guarded_processes(guarded: dict[str, str]) -> None:
    """The checks below rely on it: a non-loopback connection is refused and recorded."""
    code = ("import socket\n"
            "try:\n    socket.create_connection(('203.0.113.1', 9), 1)\n"
            "except ConnectionRefusedError as e:\n    print('refused', e)\n"
            "socket.socket().connect_ex(('127.0.0.1', 9))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=guarded, timeout=30)
    assert "refused [Errno 111] test guard" in r.stdout, r.stderr
    assert "203.0.113.1" in _guard_log(guarded) and "127.0.0.1" not in _guard_log(guarded)


# --- dry run ---------------------------------------------------------------------------------

def test_dry_run_prints_what_would_be_created_and_the_price_calls_nothing(
        guarded: dict[str, str], tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(TASK.format(name="dry", region="  region: us-east-1\n"))
    (tmp_path / "ddp_demo.py").write_text("print('hi')\n")
    # no credentials at all, and an endpoint where nothing listens: any call would fail
    env = {**guarded, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}"}
    r = _cloudtrain(env, "up", str(task), "--dry-run")
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stderr + r.stdout
    assert "nothing is created" in out
    assert "security group" in out
    assert "tcp 22 from 127.0.0.1/32" in out
    assert "all traffic from members of the same group" in out
    assert "tcp 6006 from 127.0.0.1/32" in out
    assert "key pair" in out and "cluster placement group" in out
    assert "2 x g4dn.xlarge on-demand" in out and "IMDSv2 required" in out
    assert "encrypted" in out
    (offer,) = load_catalog(None).find(provider="aws", region="us-east-1",
                                       instance_type="g4dn.xlarge")
    assert f"${offer.price:.2f}/h per node" in out
    assert f"${offer.price * 2:.2f}/h for the cluster" in out
    assert _guard_log(env) == ""
    s = _cloudtrain(env, "status", "--json")
    assert json.loads(s.stdout) == []


def test_dry_run_without_a_region_shows_the_planners_pick(guarded: dict[str, str],
                                                          tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(TASK.format(name="dry", region="").replace(
        "instance_type: g4dn.xlarge", "accelerators: A100:8"))
    (tmp_path / "ddp_demo.py").write_text("print('hi')\n")
    env = {**guarded, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}",
           "AWS_ACCESS_KEY_ID": "not-used", "AWS_SECRET_ACCESS_KEY": "not-used"}
    r = _cloudtrain(env, "up", str(task), "--dry-run")
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stderr + r.stdout
    from cloudtrain import ranking
    from cloudtrain.taskmodel import Resources

    cheapest = ranking.rank(Resources(provider="aws", accelerators="A100:8"), 2,
                            load_catalog(None).offers).ranked[0].offer
    assert f"region       {cheapest.region}" in out
    assert f"2 x {cheapest.instance_type} on-demand" in out
    assert "tcp 22 from 127.0.0.1/32" in out
    assert _guard_log(env) == ""


# --- end to end ------------------------------------------------------------------------------

@pytest.fixture
def moto_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = _free_port()
    log = open(tmp_path / "moto.log", "w")
    env = {**os.environ, "MOTO_EC2_LOAD_DEFAULT_AMIS": "false",
           "CT_MOTO_PRIVATE_IPS": str(private_ips_file(tmp_path))}
    env.pop("MOTO_AMIS_PATH", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(FAKES)!r}); "
                               "from aws_moto import serve_moto; "
                               f"serve_moto('127.0.0.1', {port})"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp_path / "moto.log").read_text()) from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def private_ips_file(tmp_path: Path) -> Path:
    """Where the moto server of a test (in ``tmp_path``) reads the stand-ins' addresses it
    hands out as the instances' private ones (aws_moto.PRIVATE_IPS_ENV)."""
    return tmp_path / "moto-private-ips.json"


class LocalNodes:
    """Two real sshd nodes on loopback standing in for the EC2 instances (tests/fakes/
    standin.py): they accept only the key the test copies from moto's key pair, moto gives
    their addresses as the instances' private ones, and the tasks reach them through
    ``resources.ssh_proxy`` (standin_proxy.py, with the map _map_when_running writes)."""

    def __init__(self, base: Path, n: int = 2) -> None:
        import getpass
        import hashlib

        import standin
        from cloudtrain_provisioners.local import sshd

        self.sshd = sshd
        self.user = getpass.getuser()
        h = int(hashlib.sha256(str(base).encode()).hexdigest()[:6], 16)
        prefix = f"127.{64 + h % 128}.{(h >> 8) % 256}"
        self.marker = f"ctaws-{h:06x}"
        self.nodes = []
        for r in range(n):
            d = base / f"node{r}"
            (d / "root").mkdir(parents=True)
            addr = f"{prefix}.{10 + r}"
            port = _free_port(addr)
            sshd.write_host_key(d / "ssh_host_ed25519_key")
            (d / "authorized_keys").write_text("")
            standin.prepare(d, address=addr, port=port, user=self.user, marker=self.marker)
            self.nodes.append({"dir": d, "address": addr, "port": port})
        self.master_port = _free_port(self.nodes[0]["address"])
        private_ips_file(base.parent).write_text(json.dumps(
            {str(r): n["address"] for r, n in enumerate(self.nodes)}))

    def start(self) -> None:
        import standin

        for n in self.nodes:
            standin.start(n["dir"])

    def install_host_key(self, rank: int, user_data_b64: str | None) -> str | None:
        """cloud-init's cc_ssh: install the host key pair the instance's user data carries,
        then restart the node's sshd so that it presents it. Returns the public key."""
        import base64

        from cloudtrain.keys import host_key_from_cloud_config

        if not user_data_b64 or getattr(self, "keep_own_host_key", False):
            return None
        pair = host_key_from_cloud_config(base64.b64decode(user_data_b64).decode())
        if pair is None:
            return None
        d = self.nodes[rank]["dir"]
        fd = os.open(d / "ssh_host_ed25519_key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(pair[0])
        (d / "ssh_host_ed25519_key.pub").write_text(pair[1] + "\n")
        pid = self.sshd.pid(d)
        self.sshd.stop(d)
        deadline = time.monotonic() + 10
        while pid is not None and time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        import standin

        standin.start(d)
        return pair[1]

    def authorize(self, public_key: str) -> None:
        for n in self.nodes:
            (n["dir"] / "authorized_keys").write_text(public_key.strip() + "\n")

    def stop(self) -> None:
        for n in self.nodes:
            self.sshd.stop(n["dir"])
        self.sshd.kill_marked(self.marker)


def _moto(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _tagged(ec2, cluster: str) -> dict[str, list]:  # type: ignore[no-untyped-def,type-arg]
    flt = [{"Name": "tag:cloudtrain:cluster", "Values": [cluster]}]
    live = ["pending", "running", "stopping", "stopped", "shutting-down"]
    return {
        "instances": [i for r in ec2.describe_instances(Filters=flt + [
            {"Name": "instance-state-name", "Values": live}])["Reservations"] for i in r["Instances"]],
        "security_groups": ec2.describe_security_groups(Filters=flt)["SecurityGroups"],
        "key_pairs": ec2.describe_key_pairs(Filters=flt)["KeyPairs"],
        "placement_groups": ec2.describe_placement_groups(Filters=flt)["PlacementGroups"],
        "volumes": ec2.describe_volumes(Filters=flt)["Volumes"],
    }


def _map_when_running(ec2, nodes: LocalNodes, cluster: str, map_file: Path,  # type: ignore[no-untyped-def]
                      seen: dict[str, object], stop: threading.Event) -> None:
    """What a test has to do for the "instances" to be reachable: once moto runs both, give
    the local nodes the key moto's key pair holds, bind each node to its instance (what its
    guest shutdown tells moto), then map each instance's public address (and its private
    one, the stand-in's own) to its node in the proxy map (``map_file``)."""
    import standin

    while not stop.is_set():
        insts = [i for i in _tagged(ec2, cluster)["instances"] if i["State"]["Name"] == "running"]
        if len(insts) == len(nodes.nodes):
            (kp,) = ec2.describe_key_pairs(KeyNames=[insts[0]["KeyName"]],
                                           IncludePublicKey=True)["KeyPairs"]
            nodes.authorize(kp["PublicKey"])
            entries: dict[str, tuple[str, int]] = {}
            host_keys = {}
            for i in insts:
                rank = int({t["Key"]: t["Value"] for t in i["Tags"]}["cloudtrain:node-rank"])
                ud = ec2.describe_instance_attribute(InstanceId=i["InstanceId"],
                                                     Attribute="userData")["UserData"]
                host_keys[rank] = nodes.install_host_key(rank, ud.get("Value"))
                n = nodes.nodes[rank]
                standin.bind(n["dir"], "aws", "--endpoint", ec2.meta.endpoint_url,
                             "--region", ec2.meta.region_name, "--instance", i["InstanceId"])
                entries[i["PublicIpAddress"]] = (n["address"], n["port"])
                entries[i["PrivateIpAddress"]] = (n["address"], n["port"])
                seen.setdefault("private", {})[rank] = i["PrivateIpAddress"]  # type: ignore[index]
            seen["invented"] = sorted(i["PublicIpAddress"] for i in insts)
            seen["placement_groups"] = len(_tagged(ec2, cluster)["placement_groups"])
            seen["key"] = kp["PublicKey"]
            seen["host_keys"] = host_keys
            standin.ProxyMap(map_file).add(entries)
            return
        time.sleep(0.2)


def aws_task(task: Path, map_file: Path, nodes: LocalNodes) -> Path:
    """``task`` reaching ``nodes`` through the stand-ins' proxy (standin.use_proxy)."""
    import standin

    return standin.use_proxy(task, map_file, "aws", nodes.user, master_port=nodes.master_port)


def relayed_only_to_loopback(map_file: Path, invented: list[str]) -> None:
    """Every SSH connection went through the test's proxy, and the proxy only ever connected
    to loopback: nothing connected to an address moto invented."""
    import standin

    relays = standin.ProxyMap(map_file)
    assert relays.relayed, "ssh went through the stand-ins' proxy"
    assert relays.only_loopback(), relays.relayed
    assert {asked.rsplit(":", 1)[0] for asked, _ in relays.relayed} <= set(invented) | {
        e["host"] for e in relays.read().values()}


@needs_sshd
@needs_torch
@pytest.mark.e2e
def test_launch_down_two_nodes_through_the_cli_against_moto(
        guarded: dict[str, str], moto_server: str, tmp_path: Path) -> None:
    import shutil

    proj = tmp_path / "proj"
    shutil.copytree(DEMO, proj, ignore=shutil.ignore_patterns("cloudtrain-outputs", "__pycache__"))
    task = proj / "task-aws.yaml"
    task.write_text(TASK.format(name="awsdemo", region="  region: us-east-1\n"))
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    ec2 = _moto(moto_server)
    nodes = LocalNodes(tmp_path / "nodes")
    aws_task(task, map_file, nodes)
    nodes.start()
    seen: dict[str, object] = {}
    stop = threading.Event()
    mapper = threading.Thread(target=_map_when_running,
                              args=(ec2, nodes, "awsdemo", map_file, seen, stop), daemon=True)
    mapper.start()
    try:
        r = _cloudtrain(env, "launch", str(task), "--down", "-y", timeout=400)
        assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    finally:
        stop.set()
        mapper.join(timeout=10)
        nodes.stop()
    out = r.stderr + r.stdout
    assert "Provisioning 2 node(s) on aws" in out
    assert seen["placement_groups"] == 1          # g4dn supports cluster placement groups
    result = json.loads((proj / "cloudtrain-outputs" / "outputs" / "result.json").read_text())
    assert result["world_size"] == 4 and result["num_nodes"] == 2
    assert result["allreduce_sum"] == 6.0 and result["replicas_in_sync"] is True
    # moto holds nothing of the cluster any more, and the state forgot it
    assert {k: len(v) for k, v in _tagged(ec2, "awsdemo").items()} == {
        "instances": 0, "security_groups": 0, "key_pairs": 0, "placement_groups": 0,
        "volumes": 0}
    every = [i for res in ec2.describe_instances()["Reservations"] for i in res["Instances"]]
    assert len(every) == 2 and {i["State"]["Name"] for i in every} == {"terminated"}
    assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []
    # the nodes accepted only the key moto's key pair held: cloudtrain's cluster key
    assert str(seen["key"]).startswith("ssh-ed25519 ")
    # each node presented the host key cloudtrain put in its user data (cloudtrain pinned it
    # before the first connection and would have refused any other)
    assert sorted(seen["host_keys"]) == [0, 1]  # type: ignore[call-overload]
    assert all(str(k).startswith("ssh-ed25519 ") for k in seen["host_keys"].values())  # type: ignore[attr-defined]
    # the nodes' private addresses are the stand-ins' own (MASTER_ADDR is reachable)
    assert seen["private"] == {r: n["address"] for r, n in enumerate(nodes.nodes)}
    # no connection to an address moto invented, from cloudtrain or from rsync's ssh: every
    # one went through the proxy, which connected only to the stand-ins on loopback
    assert _guard_log(env) == ""
    ssh_log = Path(env["CT_TEST_SSH_LOG"]).read_text()
    assert ssh_log, "rsync went through ssh"
    relayed_only_to_loopback(map_file, seen["invented"])  # type: ignore[arg-type]


def test_the_stand_in_proxy_refuses_unmapped_addresses(tmp_path: Path) -> None:
    """The tests' ssh_proxy never connects to an address the test's map does not give (nor
    to one it maps off loopback), and the provider hands back plain nodes: the address EC2
    gave, port 22, the image's user, files under ~/cloudtrain."""
    import standin
    from cloudtrain.provider import HasMasterPort, ProviderContext
    from cloudtrain_provisioners.aws import AWSProvider
    from cloudtrain_provisioners.aws.instances import Inst

    f = tmp_path / "proxy-map.json"
    standin.ProxyMap(f).add({"54.1.2.3": ("127.0.0.9", 2222), "54.6.6.6": ("10.0.0.3", 22)})
    for host in ("54.9.9.9", "54.6.6.6"):
        r = subprocess.run([sys.executable, str(standin.PROXY), str(f), host, "22", "0"],
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and "refus" in r.stderr, r.stderr
    assert standin.ProxyMap(f).relayed == []
    p = AWSProvider(ProviderContext(tmp_path), clients=object())  # type: ignore[arg-type]
    i = Inst("i-1", 0, "running", "us-east-1a", "us-east-1", "54.1.2.3", "10.0.0.3", "",
             False, "", "g4dn.xlarge")
    n = p._node(i, (), "ubuntu", True)
    assert (n.host, n.port, n.internal_ip, n.user, n.root_dir) == ("54.1.2.3", 22, "10.0.0.3",
                                                                    "ubuntu", "cloudtrain")
    assert p._node(i, (), "ubuntu", False).host == "10.0.0.3"
    assert not isinstance(p, HasMasterPort) and p.node_env("none") == {}   # no fabric
