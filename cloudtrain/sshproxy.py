"""``resources.ssh_proxy``: nodes reached through a jump host (a bastion in front of a private
subnet), docs/ssh.md "Through a bastion".

The value is one of two forms:

- a ProxyJump spec, ``[user@]host[:port]`` or a comma-separated chain of them (the first hop
  is reached first), e.g. ``admin@bastion.example.com:2222``;
- a ProxyCommand: a command line with ``%h`` and ``%p`` (the node's address and port), whose
  stdin and stdout carry the connection, e.g. ``ssh -W %h:%p bastion`` or
  ``nc -X connect -x proxy:3128 %h %p``.

Every connection to a node goes through it: cloudtrain's own (OpenSSH masters and clients,
rsync's ssh, paramiko when multiplexing is off, port forwards) and the per-cluster ssh config
(``ssh NAME``, VS Code). A ProxyJump spec becomes the ProxyCommand OpenSSH's own ProxyJump
would run (``ssh [-l USER] [-p PORT] [-J EARLIER,HOPS] -W '[%h]:%p' LAST_HOP``) but without
the ``-F`` of the node connection: the jump host is reached as the user's own ``ssh HOP``
reaches it (their ~/.ssh/config, agent, keys and known_hosts), and the cluster's key and
pinned known_hosts are never offered to it.

:func:`ssh_answers` is the one check that reaches a node without logging in (``status``'s
live check of the ssh provider's hosts): directly, or through the proxy.
"""

from __future__ import annotations

import ipaddress
import os
import re
import selectors
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cloudtrain.schema import NodeRow

FIELD = "resources.ssh_proxy"
MAX_LENGTH = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,31}\Z")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?\Z")
_HOP = re.compile(r"(?:(?P<user>[^@]*)@)?(?P<host>\[[^\]]*\]|[^:]*)(?::(?P<port>[^:]*))?\Z")

FORMS = ("write a jump host as [user@]host[:port] (or a comma-separated chain of them, e.g. "
         "admin@bastion.example.com:2222), or a proxy command with %h and %p "
         "(e.g. 'ssh -W %h:%p bastion')")


@dataclass(frozen=True)
class Hop:
    """One jump host of a ProxyJump chain."""

    host: str
    user: str | None = None
    port: int | None = None

    def argv(self) -> list[str]:
        return ([*(["-l", self.user] if self.user else []),
                 *(["-p", str(self.port)] if self.port else [])])

    def spec(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (f"{self.user}@" if self.user else "") + host + (f":{self.port}" if self.port else "")


def is_command(value: str) -> bool:
    """The ProxyCommand form (``%h``, ``%p`` and a space), rather than a ProxyJump spec."""
    return "%h" in value and "%p" in value and any(c.isspace() for c in value)


def check(value: object) -> str:
    """``value`` when it is a valid ssh_proxy (either form); a ValueError saying the two forms
    otherwise (the task loader names the field)."""
    if not isinstance(value, str):
        raise ValueError(f"expected text; {FORMS}")
    shown = repr(value[:60])
    if not value.strip() or value.startswith("-") or len(value) > MAX_LENGTH \
            or _CONTROL.search(value):
        raise ValueError(f"{shown} is not a jump host or a proxy command (empty, over "
                         f"{MAX_LENGTH} characters, starting with '-', or with a control "
                         f"character); {FORMS}")
    if is_command(value):
        return value
    try:
        hops(value)
    except ValueError:
        raise ValueError(f"{shown} is neither a jump host nor a proxy command; {FORMS}") from None
    return value


def hops(value: str) -> list[Hop]:
    """The hops of a ProxyJump spec, first first; ValueError when one is not a hop."""
    return [_hop(part) for part in value.split(",")]


def _hop(text: str) -> Hop:
    m = _HOP.fullmatch(text)
    if m is None:
        raise ValueError(text)
    user, host, port = m.group("user"), m.group("host"), m.group("port")
    if user is not None and not _USER.fullmatch(user):
        raise ValueError(text)
    if host.startswith("["):
        host = str(ipaddress.IPv6Address(host[1:-1]))     # ValueError when not an address
    elif not _NAME.fullmatch(host) or host.startswith("-"):
        raise ValueError(text)
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(text)
    return Hop(host, user, int(port) if port is not None else None)


def proxy_command(value: str, *, batch: bool) -> str:
    """The ProxyCommand for ``value`` (OpenSSH's tokens ``%h`` ``%p`` left for ssh to fill).
    ``batch``: the jump hop never prompts (cloudtrain's own connections have no terminal)."""
    if is_command(value):
        return value
    *earlier, last = hops(value)
    argv = ["ssh", *(["-o", "BatchMode=yes"] if batch else []), *last.argv(),
            *(["-J", ",".join(h.spec() for h in earlier)] if earlier else [])]
    return " ".join(shlex.quote(a) for a in argv) + f" -W '[%h]:%p' {shlex.quote(last.host)}"


def ssh_options(value: str | None) -> list[str]:
    """The options of a cloudtrain ``ssh`` command line for ``value`` (none without a proxy)."""
    if not value:
        return []
    return ["-o", "ProxyCommand=" + proxy_command(value, batch=True)]


_TOKEN = re.compile(r"%(.)")


def expanded(command: str, *, host: str, port: int, user: str) -> str:
    """``command`` with OpenSSH's ProxyCommand tokens filled (``%h`` ``%n`` host, ``%p`` port,
    ``%r`` user, ``%%``), for a client that runs it itself (paramiko)."""
    values = {"h": host, "n": host, "p": str(port), "r": user, "%": "%"}
    return _TOKEN.sub(lambda m: values.get(m.group(1), m.group(0)), command)


def shell_argv(value: str, *, host: str, port: int, user: str) -> list[str]:
    """The proxy as a process for one connection, run the way OpenSSH runs a ProxyCommand:
    ``$SHELL -c 'exec COMMAND'`` (``/bin/sh`` without $SHELL)."""
    cmd = expanded(proxy_command(value, batch=True), host=host, port=port, user=user)
    return [os.environ.get("SHELL") or "/bin/sh", "-c", "exec " + cmd]


def ssh_answers(node: NodeRow, proxy: str | None, timeout: float) -> bool:
    """Does the node's sshd greet (an SSH banner within ``timeout`` s), reached directly or
    through the cluster's proxy (``resources.ssh_proxy``)? No login, no key."""
    if not proxy:
        try:
            with socket.create_connection((node.host, node.port), timeout=timeout) as s:
                s.settimeout(timeout)
                return s.recv(64).startswith(b"SSH-")
        except OSError:
            return False
    proc = subprocess.Popen(shell_argv(proxy, host=node.host, port=node.port, user=node.user),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None
    got, end = b"", time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while len(got) < 4 and sel.select(max(0.0, end - time.monotonic())):
                chunk = os.read(proc.stdout.fileno(), 4 - len(got))
                if not chunk:
                    break
                got += chunk
        return got == b"SSH-"
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
