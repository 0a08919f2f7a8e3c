"""Per-cluster SSH identity and pinned host keys.

Each cluster gets its own ed25519 key (mode 0600) and its own known_hosts file. A node's host
key is pinned either from what the provider reports at creation, out of band (the local
provider generates the host keys itself; on AWS and Azure cloudtrain makes a key per node and
injects it through cloud-init user data; GCP reads the guest attributes its guest agent
publishes; the ssh provider reads the user's known_hosts), or, failing that, learned on the
first contact
with a freshly created node. After that, a different key is refused: there is no
``StrictHostKeyChecking=no`` anywhere in cloudtrain. How each node's key was pinned is kept
beside the known_hosts file (``pinning.json``) for ``cloudtrain status``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cloudtrain import sshproxy


@dataclass(frozen=True)
class ClusterKeys:
    dir: Path

    @property
    def private_key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def public_key_path(self) -> Path:
        return self.dir / "id_ed25519.pub"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def proxy_file(self) -> Path:
        return self.dir / "ssh_proxy"

    @property
    def proxy(self) -> str | None:
        """The cluster's ``resources.ssh_proxy`` (None: its nodes are reached directly), kept
        beside its key and pinned host keys so every later command reaches the nodes the
        same way (:func:`record_proxy`)."""
        try:
            return self.proxy_file.read_text().rstrip("\n") or None
        except FileNotFoundError:
            return None

    def public_key(self) -> str:
        return self.public_key_path.read_text().strip()


def ensure_keys(cluster_dir: Path, comment: str, proxy: str | None = None) -> ClusterKeys:
    """Create the cluster's key pair once; later calls return the same one. ``proxy``: the
    task's ``resources.ssh_proxy``, recorded for every connection to the nodes from now on."""
    keys = ClusterKeys(cluster_dir / "ssh")
    keys.dir.mkdir(parents=True, exist_ok=True)
    os.chmod(keys.dir, 0o700)
    record_proxy(keys, proxy)
    if keys.private_key.exists() and keys.public_key_path.exists():
        return keys
    from cryptography.hazmat.primitives import serialization   # only to make a key (~20 ms)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                        serialization.PublicFormat.OpenSSH)
    tmp = keys.private_key.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(priv)
    os.replace(tmp, keys.private_key)
    keys.public_key_path.write_text(pub.decode() + f" {comment}\n")
    keys.known_hosts.touch(mode=0o600, exist_ok=True)
    return keys


def record_proxy(keys: ClusterKeys, proxy: str | None) -> None:
    """Remember how the cluster's nodes are reached (the task's ``resources.ssh_proxy``; None
    forgets it: the nodes are reached directly)."""
    if proxy is None:
        keys.proxy_file.unlink(missing_ok=True)
        return
    if keys.proxy == proxy:
        return
    tmp = keys.proxy_file.with_suffix(".tmp")
    tmp.write_text(proxy + "\n")
    os.replace(tmp, keys.proxy_file)


PINNED_AT_CREATION = "pinned at creation"
FIRST_CONTACT = "learned on first contact"
USER_KNOWN_HOSTS = "the user's known_hosts"


def record_pinning(keys: ClusterKeys, how: dict[int, str]) -> None:
    """Remember how each rank's host key was (or will be) pinned; ranks not given keep theirs."""
    path = keys.dir / "pinning.json"
    try:
        old = {int(k): str(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        old = {}
    old.update(how)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(old.items())}))
    os.replace(tmp, path)


def pinning(cluster_dir: Path) -> dict[int, str]:
    """How each rank's host key was pinned ({} when nothing was recorded)."""
    try:
        data = json.loads((cluster_dir / "ssh" / "pinning.json").read_text())
        return {int(k): str(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def generate_host_key() -> tuple[str, str]:
    """A fresh ed25519 host key pair for one node: (private key in OpenSSH PEM, public line
    "ssh-ed25519 AAAA...")."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption()).decode()
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                        serialization.PublicFormat.OpenSSH).decode()
    return priv, pub


def host_key_cloud_config(private: str, public: str) -> str:
    """cloud-init user data that installs this host key pair as the node's only SSH host key
    before sshd first starts (cc_ssh: ``ssh_keys``; no key of its own is generated)."""
    import yaml

    return "#cloud-config\n" + yaml.safe_dump(
        {"ssh_deletekeys": True, "ssh_genkeytypes": [],
         "ssh_keys": {"ed25519_private": private, "ed25519_public": public}},
        default_style=None, sort_keys=True)


def host_key_from_cloud_config(text: str) -> tuple[str, str] | None:
    """The (private, public) ed25519 host key in cloud-init user data, as cloud-init reads it."""
    import yaml

    if not text.startswith("#cloud-config"):
        return None
    data = yaml.safe_load(text) or {}
    keys = data.get("ssh_keys") or {}
    if "ed25519_private" not in keys or "ed25519_public" not in keys:
        return None
    return str(keys["ed25519_private"]), str(keys["ed25519_public"])


def host_entry_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def pin_host_keys(known_hosts: Path, host: str, port: int, key_lines: tuple[str, ...]) -> None:
    """Record the given host keys ("ssh-ed25519 AAAA...") for host:port, replacing older ones
    for that address (a new node at a reused address gets its own key)."""
    name = host_entry_name(host, port)
    lines = known_hosts.read_text().splitlines() if known_hosts.exists() else []
    kept = [ln for ln in lines if ln.split(" ", 1)[0] != name]
    for key in key_lines:
        parts = key.split()
        kept.append(f"{name} {parts[0]} {parts[1]}")
    known_hosts.write_text("\n".join(kept) + ("\n" if kept else ""))
    os.chmod(known_hosts, 0o600)


def forget_host(known_hosts: Path, host: str, port: int) -> None:
    pin_host_keys(known_hosts, host, port, ())


def is_pinned(known_hosts: Path, host: str, port: int) -> bool:
    if not known_hosts.exists():
        return False
    name = host_entry_name(host, port)
    return any(ln.split(" ", 1)[0] == name for ln in known_hosts.read_text().splitlines())


def ssh_command_options(keys: ClusterKeys, port: int, identity_file: str | None = None,
                        connect_timeout: int = 10, learn: bool = False) -> list[str]:
    """Options for the system ``ssh`` (the node connections, rsync, ``cloudtrain ssh``): our
    key, our known_hosts, strict checking, the cluster's proxy when it has one
    (``resources.ssh_proxy``), and nothing from the user's ssh config. ``learn``: a node with
    no pinned key yet may have its key learned (``accept-new``; a different key than one
    already pinned is still refused)."""
    return [
        *sshproxy.ssh_options(keys.proxy),
        "-F", "/dev/null",
        "-i", identity_file or str(keys.private_key),
        "-p", str(port),
        "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={keys.known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", f"StrictHostKeyChecking={'accept-new' if learn else 'yes'}",
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={connect_timeout}",
        "-o", "ServerAliveInterval=15",
        "-o", "LogLevel=ERROR",
    ]
