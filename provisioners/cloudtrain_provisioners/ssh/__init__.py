"""The ``ssh`` provider: machines the user already has.

``up`` reaches them and bootstraps; ``down`` stops the processes cloudtrain started there and
forgets the hosts. It never powers anything off and never deletes the user's files.

Host keys: a host the user's own ``~/.ssh/known_hosts`` knows (hashed entries included) is
pinned with the keys listed there, so a host presenting another key is refused exactly as
``ssh`` would refuse it; a host it does not know is learned on first contact.
"""

from __future__ import annotations

import getpass
import ipaddress
import json
import os
import re
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cloudtrain.errors import UserError
from cloudtrain.provider import (USER_KNOWN_HOSTS, ClusterRequest, NetworkRef, Node, Plan,
                                 ProviderCheck, ProviderContext, host_entry_name)

DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _address(v: str, what: str) -> str:
    """A host name (letters, digits, '-' and '.') or an IP address: nothing that ssh, rsync or
    an OpenSSH config file could read as an option or a directive (e.g. '-oProxyCommand=...')."""
    try:
        return str(ipaddress.ip_address(v))
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(v):
        shown = v if len(v) <= 60 else v[:57] + "..."
        raise ValueError(f"{what} {shown!r} is neither a host name (letters, digits, '-' and "
                         "'.', not starting with '-') nor an IP address; write e.g. "
                         "203.0.113.10 or gpu-1.example.com")
    return v


class SSHHost(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str
    port: int = Field(22, ge=1, le=65535)
    user: str = Field(default_factory=getpass.getuser)
    identity_file: str | None = None
    internal_ip: str | None = Field(
        None, description="Address the other hosts reach this one at (default: address).")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return _address(v, "the address")

    @field_validator("internal_ip")
    @classmethod
    def _internal(cls, v: str | None) -> str | None:
        return None if v is None else _address(v, "internal_ip")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER.fullmatch(v):
            raise ValueError(f"the user {v[:40]!r} is not a login name (letters, digits, '_', "
                             "'.' and '-', not starting with '-'); write e.g. ubuntu")
        return v

    @field_validator("identity_file")
    @classmethod
    def _identity_file(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or v.startswith("-") or _CONTROL.search(v)
                              or len(v.encode("utf-8", "surrogatepass")) > 4096):
            raise ValueError("identity_file is the path of a private key on this machine, "
                             "e.g. ~/.ssh/id_ed25519 (not empty, no control characters, not "
                             "starting with '-', at most 4096 bytes)")
        return v


class SSHOptions(BaseModel):
    """``resources.ssh`` in a task file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: list[SSHHost] = Field(min_length=1)

    @field_validator("hosts", mode="before")
    @classmethod
    def _strings(cls, v: object) -> object:
        # Also accept "user@host:port" strings.
        if isinstance(v, list):
            out = []
            for h in v:
                if isinstance(h, str):
                    user, _, rest = h.rpartition("@")
                    if rest.startswith("["):            # [IPv6]:PORT
                        addr, _, port = rest[1:].partition("]")
                        port = port.removeprefix(":")
                    elif rest.count(":") > 1:           # a bare IPv6 address
                        addr, port = rest, ""
                    else:
                        addr, _, port = rest.partition(":")
                    d: dict[str, object] = {"address": addr}
                    if user:
                        d["user"] = user
                    if port:
                        d["port"] = int(port) if port.isdigit() else port
                    out.append(d)
                else:
                    out.append(h)
            return out
        return v


def user_known_host_keys(host: str, port: int,
                         files: tuple[Path, ...] | None = None) -> tuple[str, ...]:
    """The keys ("type base64") the user's known_hosts files list for host:port."""
    import paramiko

    found: list[str] = []
    for f in files if files is not None else (Path.home() / ".ssh" / "known_hosts",):
        if not f.is_file():
            continue
        try:
            hk = paramiko.HostKeys(str(f))
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise UserError(f"cannot read your known_hosts file {f} ({exc}).",
                            "Fix or remove the broken line (ssh-keygen -R <host> removes a "
                            "host's entries).") from None
        entry = hk.lookup(host_entry_name(host, port))
        for typ, key in (entry or {}).items():
            line = f"{typ} {key.get_base64()}"
            if line not in found:
                found.append(line)
    return tuple(found)


class SSHProvider:
    name: ClassVar[str] = "ssh"
    host_key_source: ClassVar[str] = USER_KNOWN_HOSTS
    options_model: ClassVar[type[BaseModel] | None] = SSHOptions
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = False
    list_is_cheap: ClassVar[bool] = True

    def __init__(self, ctx: ProviderContext) -> None:
        self.ctx = ctx

    def _file(self, cluster: str) -> Path:
        return self.ctx.cluster_dir(cluster) / "ssh-hosts.json"

    def check_access(self, timeout: float) -> ProviderCheck:
        """``cloudtrain check``: no SDK and no account; its hosts and keys are a task's."""
        return ProviderCheck("ssh", True, "your SSH keys (per host in the task)", True,
                             ("the hosts a task lists in resources.ssh.hosts",))

    @staticmethod
    def _opts(request: ClusterRequest) -> SSHOptions:
        if not isinstance(request.options, SSHOptions):
            raise UserError("provider 'ssh' needs its hosts: resources.ssh.hosts is missing.",
                            "Add e.g.  ssh: {hosts: [{address: 203.0.113.10, user: ubuntu, "
                            "identity_file: ~/.ssh/id_ed25519}]}")
        return request.options

    @staticmethod
    def _identity(h: SSHHost) -> str:
        if h.identity_file:
            p = Path(h.identity_file).expanduser()
            if not p.is_file():
                raise UserError(f"resources.ssh.hosts: identity_file '{h.identity_file}' for "
                                f"{h.address} does not exist.", "Fix the path.")
            return str(p)
        for name in DEFAULT_KEYS:
            p = Path.home() / ".ssh" / name
            if p.is_file():
                return str(p)
        raise UserError(f"resources.ssh.hosts: no identity_file for {h.address}, and no default "
                        "key in ~/.ssh.", "Give identity_file for each host.")

    def check(self, request: ClusterRequest) -> None:
        opts = self._opts(request)
        if len(opts.hosts) != request.num_nodes:
            raise UserError(
                f"num_nodes is {request.num_nodes} but resources.ssh.hosts lists "
                f"{len(opts.hosts)} host(s).", "Make them match.")
        for h in opts.hosts:
            self._identity(h)
        if request.resources.use_spot:
            raise UserError("resources.use_spot does not apply to the ssh provider.",
                            "Remove it.")

    def plan(self, request: ClusterRequest) -> Plan:
        opts = self._opts(request)
        return Plan(provider="ssh", num_nodes=request.num_nodes, region="your hosts",
                    instance_type="existing", hourly_price_per_node=None,
                    creates=[f"a folder ~/cloudtrain/{request.name} on "
                             + ", ".join(h.address for h in opts.hosts)],
                    notes=["existing machines: cloudtrain never powers them off"])

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        return NetworkRef("", "the hosts' own network")

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        opts = self._opts(request)
        records = [{"rank": i, "address": h.address, "port": h.port, "user": h.user,
                    "identity_file": self._identity(h), "internal_ip": h.internal_ip or h.address}
                   for i, h in enumerate(opts.hosts)]
        f = self._file(request.name)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(records, indent=1))
        os.replace(tmp, f)
        return self.list_nodes(request.name)

    def list_nodes(self, cluster: str) -> list[Node]:
        try:
            records = json.loads(self._file(cluster).read_text())
        except (OSError, ValueError):
            return []
        return [Node(rank=r["rank"], instance_id=f"{r['user']}@{r['address']}:{r['port']}",
                     host=r["address"], port=r["port"], user=r["user"],
                     internal_ip=r["internal_ip"], status="running",
                     root_dir=f"cloudtrain/{cluster}", identity_file=r["identity_file"],
                     host_keys=user_known_host_keys(r["address"], r["port"]))
                for r in records]

    def terminate(self, cluster: str) -> None:
        self._file(cluster).unlink(missing_ok=True)
