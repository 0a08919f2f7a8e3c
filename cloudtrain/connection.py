"""One SSH connection to one node: connect (retrying while sshd comes up, learning a host
key only where allowed and pinning it), run a command with its output streamed and kept, and
tell a node that stopped answering (:class:`NodeLost`, after node_timeout() of silence).

``remote`` builds the fan-out to every node of a cluster on top of this.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cloudtrain import sshproxy
from cloudtrain.errors import HostKeyMismatch, RemoteError, SSHTimeout, UserError
from cloudtrain.keys import ClusterKeys, host_entry_name, pin_host_keys

if TYPE_CHECKING:
    import paramiko

    from cloudtrain.schema import NodeRow

LineSink = Callable[[int, str], None]
_pin_lock = threading.Lock()

NODE_TIMEOUT_ENV = "CLOUDTRAIN_NODE_TIMEOUT"
DEFAULT_NODE_TIMEOUT = 60.0
KEEPALIVE_S = 10          # paramiko transport keepalive (keeps NAT and firewall state open)
TAIL_BYTES = 64 * 1024    # what a streamed command keeps in memory (for error messages)


# Every command cloudtrain sends starts with this: it marks the command as cloudtrain's own
# (CLOUDTRAIN_CONTROL in its environment) and records the SSH connection it came over
# ($HOME/.cloudtrain/control/<pid of that connection's sshd>), so the node guard does not take
# cloudtrain's sessions, or its idle persistent masters, for the user's
# (cloudtrain/node/sessions.py).
CONTROL_PREFIX = (
    'export CLOUDTRAIN_CONTROL=1; _ctc="$HOME/.cloudtrain/control"; '
    'true 2>/dev/null >"$_ctc/$PPID" || '
    '{ mkdir -p "$_ctc" && true >"$_ctc/$PPID"; } 2>/dev/null; ')
# (``true``, not ``:``: a failed redirection of a special builtin ends a POSIX shell)


def controlled(command: str) -> str:
    """``command`` marked as cloudtrain's own (see CONTROL_PREFIX)."""
    return CONTROL_PREFIX + command


def node_timeout() -> float:
    """How long a node may stay silent (no output, no answer to a probe) before it is
    declared lost: CLOUDTRAIN_NODE_TIMEOUT seconds, 60 by default."""
    return seconds_setting(NODE_TIMEOUT_ENV, DEFAULT_NODE_TIMEOUT)


def seconds_setting(name: str, default: float) -> float:
    """A positive, finite number of seconds from environment variable ``name`` (``default``
    when unset or empty); anything else is bad input naming the variable (exit 2)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise UserError(f"{name}={raw!r} is not a positive number of seconds.",
                        f"Set it to e.g. {default:.0f}, or unset it for the default "
                        f"({default:.0f} s).")
    return value


def node_address(node: NodeRow) -> str:
    """``user@host:port``, as messages name a node."""
    return f"{node.user}@{node.host}:{node.port}"


class NodeLost(RemoteError):
    """A node stopped answering (connection closed or silent past the node timeout)."""

    def __init__(self, node: NodeRow, silent: float, limit: float, why: str = "") -> None:
        self.rank = node.rank
        self.silent = silent
        super().__init__(
            f"lost the connection to node {node.rank} ({node_address(node)}): no answer for "
            f"{silent:.0f} s (limit {limit:.0f} s){f'; {why}' if why else ''}.",
            f"The node may be down or unreachable: check it with 'cloudtrain status'. The job was "
            f"stopped on the nodes that still answer; run 'cloudtrain down' if the node is gone, "
            f"or launch again. On a slow network raise {NODE_TIMEOUT_ENV} (seconds).")


class ChannelLost(Exception):
    """The channel or the transport went away without the command's exit status: args are
    (why, seconds silent). Caught by the callers in this module and ``remote``, never shown."""


class Tail:
    """The last ``limit`` bytes of a stream (or all of it when ``limit`` is None)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.buf = bytearray()

    def add(self, data: bytes) -> None:
        self.buf += data
        if self.limit is not None and len(self.buf) > 2 * self.limit:
            del self.buf[:len(self.buf) - self.limit]

    def text(self) -> str:
        data = self.buf if self.limit is None else self.buf[-self.limit:]
        return bytes(data).decode(errors="replace")


MAX_LINE_BYTES = 64 * 1024
"""A node's line longer than this reaches the sink in pieces of this size: a node that sends
output without newlines cannot grow the laptop's memory without bound."""


class LineBuffer:
    """Splits a byte stream into lines for a sink; a partial line waits for its end, up to
    :data:`MAX_LINE_BYTES`."""

    def __init__(self, rank: int, sink: LineSink) -> None:
        self.rank, self.sink = rank, sink
        self.pending = bytearray()

    def add(self, data: bytes) -> None:
        self.pending += data
        if b"\n" in data:
            *lines, rest = self.pending.split(b"\n")
            self.pending = bytearray(rest)
            for ln in lines:
                self._emit(ln)
        while len(self.pending) >= MAX_LINE_BYTES:
            self._emit(bytes(self.pending[:MAX_LINE_BYTES]))
            del self.pending[:MAX_LINE_BYTES]

    def _emit(self, line: bytes | bytearray) -> None:
        self.sink(self.rank, line.decode(errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self.pending:
            self.sink(self.rank, self.pending.decode(errors="replace"))
            self.pending = bytearray()


@dataclass
class Result:
    rank: int
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


class _LearnOnce:
    """paramiko policy: accept an unknown key only where learning is allowed, and pin it."""

    def __init__(self, known_hosts: Path, allowed: bool) -> None:
        self.known_hosts = known_hosts
        self.allowed = allowed

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.allowed:
            raise HostKeyMismatch(
                f"{hostname} presented a host key cloudtrain has not pinned.",
                "cloudtrain pins each node's key when the node is created. If this node was "
                "re-created outside cloudtrain, run 'cloudtrain down' and 'cloudtrain up' again.",
            )
        with _pin_lock:
            host, port = hostname, 22
            if hostname.startswith("["):
                host, _, p = hostname[1:].partition("]:")
                port = int(p)
            pin_host_keys(self.known_hosts, host, port, (f"{key.get_name()} {key.get_base64()}",))
        client.get_host_keys().add(hostname, key.get_name(), key)


@dataclass(frozen=True)
class Exchange:
    """How one command is run (:meth:`Transport.exchange`): ``stdin`` fed to it and then
    closed, or kept open until the session ends with ``hold_stdin`` (a follower on the node
    ends when its session does); ``combine``: its stderr merged into stdout; cut short by
    ``timeout`` (s) or ``stop``; a node silent for ``limit`` s is lost."""

    stdin: bytes | None = None
    hold_stdin: bool = False
    combine: bool = False
    timeout: float | None = None
    stop: threading.Event | None = None
    limit: float = DEFAULT_NODE_TIMEOUT


PLAIN = Exchange()
"""A command with no stdin, its own stderr, no time limit but the default node timeout."""


class Watch:
    """The clock of one exchange: cut short by ``stop`` or the ``timeout``; a node silent for
    ``limit`` s (no output, and no answer to a ``probe`` made every ``limit``/3 s, at most 5 s)
    raises :class:`ChannelLost`."""

    def __init__(self, timeout: float | None, stop: threading.Event | None, limit: float,
                 probe: Callable[[float], bool]) -> None:
        self.timeout, self.stop, self.limit, self.probe = timeout, stop, limit, probe
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.contact = self.last_probe = time.monotonic()
        self.every = min(5.0, limit / 3)

    def cut_short(self) -> str:
        """Why the exchange must end now ("stopped", "timed out ..."), or ""."""
        if self.stop is not None and self.stop.is_set():
            return "stopped"
        if self.deadline is not None and time.monotonic() > self.deadline:
            return f"timed out after {self.timeout:.0f} s"
        return ""

    def heard(self, got: bool) -> None:
        """After a wait for output: ``got`` is contact; silence is probed, then lost."""
        now = time.monotonic()
        if got:
            self.contact = now
        elif now - self.contact >= self.every and now - self.last_probe >= self.every:
            self.last_probe = now
            if self.probe(self.limit - (now - self.contact)):
                self.contact = time.monotonic()
        if time.monotonic() - self.contact > self.limit:
            raise ChannelLost("it stopped answering", self.silent())

    def silent(self) -> float:
        return time.monotonic() - self.contact


class Transport:
    """One node's connection as the fan-out uses it: ``exchange`` (one command, its output
    streamed), ``probe``, ``active``, ``close``; ``run`` builds on ``exchange``. Implemented
    over paramiko (:class:`Connection`) and over an OpenSSH master
    (:class:`cloudtrain.openssh.MuxConnection`)."""

    node: NodeRow

    @property
    def active(self) -> bool:
        raise NotImplementedError

    def probe(self, timeout: float) -> bool:
        raise NotImplementedError

    def exchange(self, command: str, *, on_data: Callable[[bytes], None],
                 on_err: Callable[[bytes], None],
                 how: Exchange = PLAIN) -> tuple[int | None, str]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def run(self, command: str, *, stdin: bytes | None = None, on_line: LineSink | None = None,
            combine: bool = False, timeout: float | None = None,
            stop: threading.Event | None = None, keep: int | None = None) -> Result:
        """Run ``command``; ``keep``: bytes of output kept in the result (all by default, the
        last TAIL_BYTES when ``on_line`` streams it). A node silent past node_timeout() (no
        output and no answer to a probe) ends the command with :class:`NodeLost`."""
        out = Tail(keep if keep is not None or on_line is None else TAIL_BYTES)
        err = Tail(TAIL_BYTES if on_line is not None else keep)
        lines = LineBuffer(self.node.rank, on_line) if on_line is not None else None

        def data(chunk: bytes) -> None:
            out.add(chunk)
            if lines is not None:
                lines.add(chunk)

        limit = node_timeout()
        try:
            code, why = self.exchange(command, on_data=data, on_err=err.add,
                                      how=Exchange(stdin=stdin, combine=combine, timeout=timeout,
                                                   stop=stop, limit=limit))
        except ChannelLost as exc:
            if lines is not None:
                lines.flush()
            return Result(self.node.rank, None, out.text(), err.text(),
                          NodeLost(self.node, float(exc.args[1]), limit, str(exc.args[0])))
        if lines is not None:
            lines.flush()
        if why:
            return Result(self.node.rank, None, out.text(), err.text(), RemoteError(why))
        return Result(self.node.rank, code, out.text(), err.text())


class Connection(Transport):
    def __init__(self, node: NodeRow, client: paramiko.SSHClient) -> None:
        self.node = node
        self.client = client
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(KEEPALIVE_S)

    @property
    def active(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def probe(self, timeout: float) -> bool:
        """Does the node's sshd still answer? (a session channel opened and closed)"""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            return False
        try:
            chan = transport.open_session(timeout=max(0.5, timeout))
        except Exception:  # noqa: BLE001 - any failure means no answer
            return False
        chan.close()
        return True

    def exchange(self, command: str, *, on_data: Callable[[bytes], None],
                 on_err: Callable[[bytes], None],
                 how: Exchange = PLAIN) -> tuple[int | None, str]:
        """The core of one command, run as ``how`` says: returns (exit code, "") or (None, why
        it was cut short: stopped or timed out); raises ChannelLost(why, seconds silent) when
        the node is gone."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ChannelLost("the SSH connection was closed", 0.0)
        try:
            chan = transport.open_session(timeout=how.limit)
        except Exception as exc:  # noqa: BLE001 - no channel: the connection is gone
            raise ChannelLost(f"no channel ({exc or type(exc).__name__})", how.limit) from None
        try:
            chan.set_combine_stderr(how.combine)
            chan.exec_command(controlled(command))
            if how.stdin is not None:
                chan.sendall(how.stdin)
            if not how.hold_stdin:
                chan.shutdown_write()
            chan.settimeout(0.2)
            watch = Watch(how.timeout, how.stop, how.limit, self.probe)
            while True:
                why = watch.cut_short()
                if why:
                    return None, why
                got = False
                try:
                    chunk = chan.recv(65536)
                    if chunk:
                        got = True
                        on_data(chunk)
                except TimeoutError:
                    pass
                while chan.recv_stderr_ready():
                    got = True
                    on_err(chan.recv_stderr(65536))
                if not got and chan.exit_status_ready() and not chan.recv_ready():
                    break
                watch.heard(got)
            while chan.recv_stderr_ready():
                on_err(chan.recv_stderr(65536))
            code = chan.recv_exit_status()
            if code == -1:   # closed without an exit status: the session or connection died
                raise ChannelLost("the SSH session was closed", watch.silent())
            return code, ""
        finally:
            chan.close()

    def close(self) -> None:
        self.client.close()


def _load_key(path: Path) -> paramiko.PKey:
    import paramiko

    try:
        return paramiko.PKey.from_path(str(path))
    except (OSError, paramiko.SSHException) as exc:
        raise RemoteError(f"cannot read the SSH key {path} ({exc}).",
                          "Check that the file exists, is a private key, and has no passphrase "
                          "(or load it into a key file without one).") from None


def proxy_sock(keys: ClusterKeys, node: NodeRow) -> paramiko.ProxyCommand | None:
    """The cluster's proxy (``resources.ssh_proxy``) as paramiko's socket for one connection
    to ``node``, run as OpenSSH runs a ProxyCommand; None when it has none."""
    import shlex

    import paramiko

    proxy = keys.proxy
    if not proxy:
        return None
    return paramiko.ProxyCommand(shlex.join(sshproxy.shell_argv(
        proxy, host=node.host, port=node.port, user=node.user)))


def connect(node: NodeRow, keys: ClusterKeys, *, deadline: float, learn: bool = False,
            stop: threading.Event | None = None) -> Connection:
    """Connect to one node, retrying until ``deadline`` (time.monotonic) while sshd comes up."""
    import paramiko

    # paramiko logs a traceback for every connection that breaks in its transport thread (a
    # node going away mid-handshake); the failure is reported by the caller, once, by name.
    import logging

    if not logging.getLogger("paramiko").handlers:
        logging.getLogger("paramiko").addHandler(logging.NullHandler())
    pkey = _load_key(Path(node.identity_file) if node.identity_file else keys.private_key)
    last: BaseException | None = None
    delay = 0.05
    while True:
        client = paramiko.SSHClient()
        if keys.known_hosts.exists():
            client.load_host_keys(str(keys.known_hosts))
        client.set_missing_host_key_policy(_LearnOnce(keys.known_hosts, learn))
        left = deadline - time.monotonic()
        try:
            client.connect(node.host, port=node.port, username=node.user, pkey=pkey,
                           sock=proxy_sock(keys, node),
                           look_for_keys=False, allow_agent=False, timeout=max(1.0, min(left, 10)),
                           banner_timeout=max(1.0, min(left, 15)), auth_timeout=max(1.0, min(left, 15)))
            return Connection(node, client)
        except paramiko.BadHostKeyException:
            client.close()
            raise HostKeyMismatch(
                f"node {node.rank} ({host_entry_name(node.host, node.port)}) presented a host key "
                "different from the one pinned when it was created.",
                "Someone may be intercepting the connection, or the node was replaced outside "
                "cloudtrain. If you replaced it, run 'cloudtrain down' then 'cloudtrain up'.",
            ) from None
        except HostKeyMismatch:
            client.close()
            raise
        except paramiko.AuthenticationException as exc:
            client.close()
            last = exc
            # Keys may still be landing on a new machine (cloud-init); keep trying till the deadline.
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            last = exc
        if time.monotonic() + delay > deadline or (stop is not None and stop.is_set()):
            raise SSHTimeout(
                f"node {node.rank} ({node.user}@{node.host}:{node.port}) did not accept SSH in time "
                f"(last error: {last or 'none'}).",
                "Check that the node is running ('cloudtrain status') and that your address may "
                "reach port 22 (resources.ssh_cidr).",
            )
        if stop is not None:
            if stop.wait(delay):
                raise SSHTimeout(f"stopped while connecting to node {node.rank}.", "")
        else:
            time.sleep(delay)
        delay = min(delay * 2, 1.0)
