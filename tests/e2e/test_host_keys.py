"""Finding 11: a node's SSH host key is learned out of band where the provider allows it, and
``status`` says how each node's key was pinned.

- GCP: the guest agent publishes the host keys in the instance's guest attributes
  (``hostkeys/``); cloudtrain reads and pins them before its first connection. In the e2e
  world the fake plays the guest agent and publishes the host key of the local sshd node the
  instance's address maps to; a node that presents another key than the published one is
  refused on first contact.
- ssh provider: a host the user's own ~/.ssh/known_hosts knows is pinned with those keys; a
  host presenting another key is refused, as ``ssh`` would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]


def _other_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pub = Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return pub.decode()


# --- GCP: guest attributes -------------------------------------------------------------------

HAVE_GCP = True
try:
    import google.cloud.compute_v1  # noqa: F401

    from test_gcp_e2e import NAT, world  # noqa: F401  (the e2e world fixture, used by name)
except ImportError:  # pragma: no cover - the gcp extra is not installed
    HAVE_GCP = False

needs_gcp = pytest.mark.skipif(not HAVE_GCP, reason="google-cloud-compute not installed")

GCP_TASK = ("name: keys\nnum_nodes: 2\nrun: 'true'\nresources:\n  provider: gcp\n"
            "  region: us-central1\n  accelerators: T4:1\n  ssh_cidr: 198.51.100.7/32\n")


def _known_hosts(cli: CLI, name: str) -> str:
    return (cli.home / "clusters" / name / "ssh" / "known_hosts").read_text()


@needs_gcp
def test_gcp_host_keys_are_pinned_from_guest_attributes_before_first_contact(
        world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake, nodes, _authorized = world
    task = tmp_path / "task.yaml"
    task.write_text(GCP_TASK)
    nodes.use(task)
    r = cli.run("up", str(task), "--no-bootstrap", timeout=300, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    # the instances were asked to publish their keys, and cloudtrain read them
    for body in fake.inserted_instances():
        items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
        assert items["enable-guest-attributes"] == "TRUE"
    assert fake.calls("GET", "/getGuestAttributes")
    # what is pinned is exactly what the guest agent published: the nodes' real keys, under
    # the addresses GCE gave (the proxy takes each to its node)
    from cloudtrain.keys import host_entry_name

    kh = _known_hosts(cli, "keys")
    for nat, key in zip(NAT, nodes.host_keys):
        assert f"{host_entry_name(nat, 22)} {key}" in kh
    st = cli.run("status", "--json", **env)
    assert st.returncode == 0, st.stderr
    [c] = json.loads(st.stdout)
    assert [n["host_key"] for n in c["nodes"]] == ["pinned at creation"] * 2
    table = cli.run("status", **env)
    assert "HOST KEYS" in table.stdout and "pinned at creation" in table.stdout
    d = cli.run("down", "keys", "-y", timeout=120, **env)
    assert d.returncode == 0, d.stderr
    assert fake.empty(), fake.ours()


@needs_gcp
def test_gcp_node_presenting_another_key_than_published_is_refused(
        world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake, nodes, _authorized = world
    nodes.publish_instead = [_other_key()]   # the "instance" says X, the node presents Y
    task = tmp_path / "task.yaml"
    task.write_text(GCP_TASK)
    nodes.use(task)
    r = cli.run("up", str(task), "--no-bootstrap", timeout=300, **env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "presented a host key different" in out and "Traceback" not in out, out
    # nothing was learned from the node itself
    kh_file = cli.home / "clusters" / "keys" / "ssh" / "known_hosts"
    kh = kh_file.read_text() if kh_file.exists() else ""
    assert not any(k.split()[1] in kh for k in nodes.host_keys)
    # the fresh cluster was rolled back: nothing left in the project or in the state
    assert fake.empty(), fake.ours()
    assert json.loads(cli.run("status", "--json", **env).stdout) == []


# --- Azure: a host key cloudtrain makes, injected through customData --------------------------

try:
    import test_azure_e2e as AZ
except Exception:  # noqa: BLE001 - the azure extra is not installed  # pragma: no cover
    AZ = None  # type: ignore[assignment]

needs_azure = pytest.mark.skipif(AZ is None, reason="azure SDK not installed")

AZ_TASK = ("name: azkeys\nnum_nodes: 2\nrun: 'true'\nresources:\n  provider: azure\n"
           "  region: eastus\n  instance_type: Standard_NC4as_T4_v3\n  ssh_cidr: 127.0.0.1/32\n")


@pytest.fixture
def az_world(tmp_path: Path):  # type: ignore[no-untyped-def]
    """test_azure_e2e's world (ARM fake, sshd nodes, the booter playing cloud-init)."""
    yield from AZ.world.__wrapped__(tmp_path)


@needs_azure
def test_azure_host_key_is_made_by_cloudtrain_injected_and_pinned(
        az_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake, nodes, booter, env = az_world
    task = tmp_path / "task.yaml"
    task.write_text(AZ_TASK)
    nodes.use(task)
    r = AZ._cloudtrain(env, "up", str(task), "--no-bootstrap", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # each VM got its own key in customData; ARM never shows customData back
    assert sorted(booter.host_keys) == [0, 1]
    assert len(set(booter.host_keys.values())) == 2
    puts = fake.ops_of("PUT", "virtualmachines")
    assert all(p.body["properties"]["osProfile"]["customData"] for p in puts)
    assert "customData" not in json.dumps(fake.resources)
    home = Path(env["CLOUDTRAIN_HOME"])
    kh = (home / "clusters" / "azkeys" / "ssh" / "known_hosts").read_text()
    from cloudtrain.keys import host_entry_name

    for rank, n in enumerate(nodes.nodes):   # under the VM's public address (the proxy's way)
        (public,) = [a for a, to in booter.addresses.items() if to == (n["address"], n["port"])]
        assert f"{host_entry_name(public, 22)} {booter.host_keys[rank]}" in kh
    [c] = json.loads(AZ._cloudtrain(env, "status", "--json").stdout)
    assert [n["host_key"] for n in c["nodes"]] == ["pinned at creation"] * 2
    d = AZ._cloudtrain(env, "down", "azkeys", "-y", timeout=200)
    assert d.returncode == 0, d.stderr
    assert fake.everything() == []


@needs_azure
def test_azure_node_presenting_another_key_than_injected_is_refused(
        az_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake, nodes, booter, env = az_world
    booter.keep_own_host_key = True
    task = tmp_path / "task.yaml"
    task.write_text(AZ_TASK)
    nodes.use(task)
    r = AZ._cloudtrain(env, "up", str(task), "--no-bootstrap", timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "presented a host key different" in out and "Traceback" not in out, out
    # rolled back: nothing in the subscription, nothing in the state
    assert fake.everything() == []
    assert json.loads(AZ._cloudtrain(env, "status", "--json").stdout) == []


# --- AWS: a host key cloudtrain makes, injected through user data -----------------------------

try:
    import test_aws_cli as AWSCLI
    from test_aws_cli import guarded, moto_server  # noqa: F401  (fixtures, used by name)
except Exception:  # noqa: BLE001 - boto3/moto not installed  # pragma: no cover
    AWSCLI = None  # type: ignore[assignment]

needs_aws = pytest.mark.skipif(AWSCLI is None, reason="boto3/moto not installed")

AWS_TASK = ("name: awskeys\nnum_nodes: 2\nrun: 'true'\nresources:\n  provider: aws\n"
            "  region: us-east-1\n  instance_type: g4dn.xlarge\n  ssh_cidr: 127.0.0.1/32\n")


def _aws_up(guarded: dict, moto_server: str, tmp_path: Path,  # type: ignore[type-arg]
            keep_own_host_key: bool):  # type: ignore[no-untyped-def]
    import threading

    task = tmp_path / "task.yaml"
    task.write_text(AWS_TASK)
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    ec2 = AWSCLI._moto(moto_server)
    nodes = AWSCLI.LocalNodes(tmp_path / "nodes")
    AWSCLI.aws_task(task, map_file, nodes)
    nodes.keep_own_host_key = keep_own_host_key  # type: ignore[attr-defined]
    nodes.start()
    seen: dict[str, object] = {}
    stop = threading.Event()
    mapper = threading.Thread(target=AWSCLI._map_when_running,
                              args=(ec2, nodes, "awskeys", map_file, seen, stop), daemon=True)
    mapper.start()
    try:
        r = AWSCLI._cloudtrain(env, "up", str(task), "--no-bootstrap", timeout=300)
        st = AWSCLI._cloudtrain(env, "status", "--json")
        d = AWSCLI._cloudtrain(env, "down", "-a", "-y", timeout=200)
    finally:
        stop.set()
        mapper.join(timeout=10)
        nodes.stop()
    return r, st, d, seen, ec2


@needs_aws
def test_aws_host_key_is_injected_through_user_data_and_pinned(
        guarded, moto_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r, st, d, seen, ec2 = _aws_up(guarded, moto_server, tmp_path, keep_own_host_key=False)
    assert r.returncode == 0, r.stderr[-3000:]
    [c] = json.loads(st.stdout)
    assert [n["host_key"] for n in c["nodes"]] == ["pinned at creation"] * 2
    assert all(str(k).startswith("ssh-ed25519 ") for k in seen["host_keys"].values())  # type: ignore[attr-defined]
    assert d.returncode == 0, d.stderr
    assert AWSCLI._tagged(ec2, "awskeys")["instances"] == []


@needs_aws
def test_aws_node_presenting_another_key_than_injected_is_refused(
        guarded, moto_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r, st, _d, _seen, ec2 = _aws_up(guarded, moto_server, tmp_path, keep_own_host_key=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "presented a host key different" in out and "Traceback" not in out, out
    assert json.loads(st.stdout) == []                      # rolled back
    assert AWSCLI._tagged(ec2, "awskeys")["instances"] == []


# --- ssh provider: the user's known_hosts ----------------------------------------------------

def _hosts_cluster(cli: CLI, tmp_path: Path) -> tuple[list[dict], Path]:  # type: ignore[type-arg]
    """Two local sshd nodes standing in for the user's hosts; their real host keys."""
    t = tmp_path / "hosts.yaml"
    t.write_text("name: hosts\nnum_nodes: 2\nrun: 'true'\n")
    r = cli.run("up", str(t), "--no-bootstrap")
    assert r.returncode == 0, r.stderr
    nodes = cli.status()[0]["nodes"]
    # the local provider makes its nodes' host keys itself
    assert [n["host_key"] for n in nodes] == ["pinned at creation"] * 2
    return nodes, cli.home / "clusters" / "hosts" / "ssh"


def _ssh_task(tmp_path: Path, hosts: list[dict], key: Path) -> Path:  # type: ignore[type-arg]
    entries = "\n".join(f"      - {{address: {h['host']}, port: {h['port']}, "
                        f"identity_file: {key}}}" for h in hosts)
    task = tmp_path / "mine.yaml"
    task.write_text(f"name: mine\nnum_nodes: 2\nresources:\n  provider: ssh\n  ssh:\n"
                    f"    hosts:\n{entries}\nbootstrap:\n  python: {sys.executable}\n"
                    "run: 'true'\n")
    return task


def _user_home(tmp_path: Path, lines: list[str]) -> Path:
    """A HOME whose ~/.ssh/known_hosts holds ``lines`` (hashed, as HashKnownHosts writes)."""
    import paramiko

    home = tmp_path / "user-home"
    (home / ".ssh").mkdir(parents=True)
    out = []
    for ln in lines:
        name, typ, b64 = ln.split()
        out.append(f"{paramiko.HostKeys.hash_host(name)} {typ} {b64}")
    (home / ".ssh" / "known_hosts").write_text("\n".join(out) + "\n")
    return home


def test_ssh_provider_refuses_a_host_whose_key_differs_from_the_users_known_hosts(
        cli: CLI, tmp_path: Path) -> None:
    hosts, ssh_dir = _hosts_cluster(cli, tmp_path)
    wrong = [f"[{h['host']}]:{h['port']} {_other_key()}" for h in hosts]
    home = _user_home(tmp_path, wrong)
    task = _ssh_task(tmp_path, hosts, ssh_dir / "id_ed25519")
    r = cli.run("up", str(task), "--no-bootstrap", HOME=str(home))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "presented a host key different" in out and "Traceback" not in out, out
    # nothing learned from the hosts themselves (the failed up rolled its cluster back)
    kh_file = cli.home / "clusters" / "mine" / "ssh" / "known_hosts"
    kh = kh_file.read_text() if kh_file.exists() else ""
    real = _known_hosts(cli, "hosts")
    assert not any(ln.split()[-1] in kh for ln in real.splitlines() if ln.strip())
    assert [c["name"] for c in cli.status()] == ["hosts"]   # the failed up was rolled back
    assert cli.run("down", "hosts", "-y").returncode == 0
    assert wait_until(lambda: not processes_with(str(cli.home)), 10)


def test_ssh_provider_pins_the_keys_of_the_users_known_hosts(cli: CLI, tmp_path: Path) -> None:
    hosts, ssh_dir = _hosts_cluster(cli, tmp_path)
    real = [ln for ln in _known_hosts(cli, "hosts").splitlines() if ln.strip()]
    home = _user_home(tmp_path, real)
    task = _ssh_task(tmp_path, hosts, ssh_dir / "id_ed25519")
    r = cli.run("up", str(task), "--no-bootstrap", HOME=str(home))
    assert r.returncode == 0, r.stderr
    st = cli.run("status", "mine", "--json", HOME=str(home))
    [c] = json.loads(st.stdout)
    assert [n["host_key"] for n in c["nodes"]] == ["the user's known_hosts"] * 2
    assert set(_known_hosts(cli, "mine").splitlines()) == set(real)
    assert cli.run("down", "mine", "-y", HOME=str(home)).returncode == 0
    assert cli.run("down", "hosts", "-y").returncode == 0
    assert wait_until(lambda: not processes_with(str(cli.home)), 10)
