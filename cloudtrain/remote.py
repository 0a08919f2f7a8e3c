"""SSH fan-out: one connection per node, reused within a command, commands run in parallel,
and one result per node kept whatever happens (fabric's GroupResult is the model)."""

from __future__ import annotations

import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from .errors import HostKeyMismatch, RemoteError, SSHTimeout
from .keys import ClusterKeys, host_entry_name, pin_host_keys

if TYPE_CHECKING:
    import paramiko

    from .state import NodeRow

LineSink = Callable[[int, str], None]
CommandFor = Callable[["NodeRow"], str]
_pin_lock = threading.Lock()


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


class GroupResult(dict[int, Result]):
    """A result for every node, in rank order."""

    @property
    def failed(self) -> list[Result]:
        return [r for _, r in sorted(self.items()) if not r.ok]

    def raise_on_failure(self, what: str, hint: str = "") -> GroupResult:
        bad = self.failed
        if not bad:
            return self
        parts = []
        for r in bad:
            if r.error is not None:
                parts.append(f"node {r.rank}: {r.error}")
            else:
                tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
                parts.append(f"node {r.rank}: exit {r.exit_code}" + (f" ({' | '.join(tail)})" if tail else ""))
        raise RemoteError(f"{what} failed on {len(bad)} of {len(self)} node(s): " + "; ".join(parts) + ".",
                          hint)


def bash(script: str) -> str:
    """Run ``script`` under bash whatever the login shell is."""
    return "bash -c " + shlex.quote(script)


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


class Connection:
    def __init__(self, node: NodeRow, client: paramiko.SSHClient) -> None:
        self.node = node
        self.client = client

    def run(self, command: str, *, stdin: bytes | None = None, on_line: LineSink | None = None,
            combine: bool = False, timeout: float | None = None,
            stop: threading.Event | None = None) -> Result:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise RemoteError(f"the SSH connection to node {self.node.rank} was lost.",
                              "Check the node with 'cloudtrain status'.")
        chan = transport.open_session()
        try:
            chan.set_combine_stderr(combine)
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
            chan.shutdown_write()
            chan.settimeout(0.2)
            out, err = bytearray(), bytearray()
            pending = bytearray()
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                if stop is not None and stop.is_set():
                    return Result(self.node.rank, None, out.decode(errors="replace"),
                                  err.decode(errors="replace"), RemoteError("stopped"))
                if deadline is not None and time.monotonic() > deadline:
                    return Result(self.node.rank, None, out.decode(errors="replace"),
                                  err.decode(errors="replace"),
                                  RemoteError(f"timed out after {timeout:.0f} s"))
                got = False
                try:
                    data = chan.recv(65536)
                    if data:
                        got = True
                        out += data
                        if on_line is not None:
                            pending += data
                            *lines, rest = pending.split(b"\n")
                            pending = bytearray(rest)
                            for ln in lines:
                                on_line(self.node.rank, ln.decode(errors="replace").rstrip("\r"))
                except socket.timeout:
                    pass
                while chan.recv_stderr_ready():
                    got = True
                    err += chan.recv_stderr(65536)
                if not got and chan.exit_status_ready() and not chan.recv_ready():
                    break
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            if on_line is not None and pending:
                on_line(self.node.rank, pending.decode(errors="replace"))
            return Result(self.node.rank, chan.recv_exit_status(), out.decode(errors="replace"),
                          err.decode(errors="replace"))
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


def connect(node: NodeRow, keys: ClusterKeys, *, deadline: float, learn: bool = False,
            stop: threading.Event | None = None) -> Connection:
    """Connect to one node, retrying until ``deadline`` (time.monotonic) while sshd comes up."""
    import paramiko

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
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


class Group:
    """Connections to every node of a cluster, opened in parallel and reused."""

    def __init__(self, nodes: Iterable[NodeRow], keys: ClusterKeys) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.rank)
        self.keys = keys
        self.conns: dict[int, Connection] = {}
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(self.nodes) * 2)),
                                        thread_name_prefix="ct-ssh")

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout: float = 120.0, learn: frozenset[int] = frozenset()) -> Group:
        deadline = time.monotonic() + timeout

        def one(node: NodeRow) -> Connection:
            return connect(node, self.keys, deadline=deadline, learn=node.rank in learn,
                           stop=self.stop)

        todo = [n for n in self.nodes if n.rank not in self.conns]
        futures = {n.rank: self._pool.submit(one, n) for n in todo}
        errors: list[BaseException] = []
        for rank, fut in futures.items():
            try:
                self.conns[rank] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - collected, then raised together
                errors.append(exc)
        if errors:
            mismatch = [e for e in errors if isinstance(e, HostKeyMismatch)]
            first = mismatch[0] if mismatch else errors[0]
            if len(errors) == 1 and hasattr(first, "hint"):
                raise first
            msgs = "; ".join(getattr(e, "message", str(e)) for e in errors)
            raise (type(first) if isinstance(first, RemoteError) else RemoteError)(
                f"{len(errors)} of {len(self.nodes)} node(s) unreachable: {msgs}",
                getattr(first, "hint", ""),
            )
        return self

    def run(self, command: str | CommandFor, *, stdin: bytes | Callable[[NodeRow], bytes] | None = None,
            on_line: LineSink | None = None, combine: bool = False, timeout: float | None = None,
            ranks: Iterable[int] | None = None,
            on_done: Callable[[Result], None] | None = None) -> GroupResult:
        wanted = set(ranks) if ranks is not None else {n.rank for n in self.nodes}

        def one(node: NodeRow) -> Result:
            try:
                cmd = command(node) if callable(command) else command
                data = stdin(node) if callable(stdin) else stdin
                res = self.conns[node.rank].run(cmd, stdin=data, on_line=on_line, combine=combine,
                                                timeout=timeout, stop=self.stop)
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                res = Result(node.rank, None, error=exc)
            if on_done is not None:
                on_done(res)
            return res

        futures = {n.rank: self._pool.submit(one, n) for n in self.nodes if n.rank in wanted}
        out = GroupResult()
        for rank, fut in futures.items():
            out[rank] = fut.result()
        return out

    def close(self) -> None:
        self.stop.set()
        for c in self.conns.values():
            c.close()
        self.conns.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
