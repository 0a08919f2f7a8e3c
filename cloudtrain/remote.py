"""SSH fan-out: one connection per node, reused within a command, commands run in parallel,
and one result per node kept whatever happens (fabric's GroupResult is the model)."""

from __future__ import annotations

import collections
import math
import os
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from cloudtrain.errors import HostKeyMismatch, RemoteError, SSHTimeout, UserError
from cloudtrain.keys import ClusterKeys, host_entry_name, pin_host_keys

if TYPE_CHECKING:
    import paramiko

    from cloudtrain.state import NodeRow

LineSink = Callable[[int, str], None]
CommandFor = Callable[["NodeRow"], str]
_pin_lock = threading.Lock()

NODE_TIMEOUT_ENV = "CLOUDTRAIN_NODE_TIMEOUT"
DEFAULT_NODE_TIMEOUT = 60.0
KEEPALIVE_S = 10          # paramiko transport keepalive (keeps NAT and firewall state open)
TAIL_BYTES = 64 * 1024    # what a streamed command keeps in memory (for error messages)


def node_timeout() -> float:
    """How long a node may stay silent (no output, no answer to a probe) before it is
    declared lost: CLOUDTRAIN_NODE_TIMEOUT seconds, 60 by default."""
    raw = os.environ.get(NODE_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_NODE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise UserError(f"{NODE_TIMEOUT_ENV}={raw!r} is not a positive number of seconds.",
                        f"Set it to e.g. {DEFAULT_NODE_TIMEOUT:.0f}, or unset it for the default "
                        f"({DEFAULT_NODE_TIMEOUT:.0f} s).")
    return value


def _address(node: NodeRow) -> str:
    return f"{node.user}@{node.host}:{node.port}"


class NodeLost(RemoteError):
    """A node stopped answering (connection closed or silent past the node timeout)."""

    def __init__(self, node: NodeRow, silent: float, limit: float, why: str = "") -> None:
        self.rank = node.rank
        self.silent = silent
        super().__init__(
            f"lost the connection to node {node.rank} ({_address(node)}): no answer for "
            f"{silent:.0f} s (limit {limit:.0f} s){f'; {why}' if why else ''}.",
            f"The node may be down or unreachable: check it with 'cloudtrain status'. The job was "
            f"stopped on the nodes that still answer; run 'cloudtrain down' if the node is gone, "
            f"or launch again. On a slow network raise {NODE_TIMEOUT_ENV} (seconds).")


class _Lost(Exception):
    """Internal: the channel or the transport went away without the command's exit status."""


class _Tail:
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


class _Lines:
    """Splits a byte stream into lines for a sink; a partial line waits for its end."""

    def __init__(self, rank: int, sink: LineSink) -> None:
        self.rank, self.sink = rank, sink
        self.pending = bytearray()

    def add(self, data: bytes) -> None:
        self.pending += data
        if b"\n" not in data:
            return
        *lines, rest = self.pending.split(b"\n")
        self.pending = bytearray(rest)
        for ln in lines:
            self.sink(self.rank, ln.decode(errors="replace").rstrip("\r"))

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

    def run(self, command: str, *, stdin: bytes | None = None, on_line: LineSink | None = None,
            combine: bool = False, timeout: float | None = None,
            stop: threading.Event | None = None, keep: int | None = None) -> Result:
        """Run ``command``; ``keep``: bytes of output kept in the result (all by default, the
        last TAIL_BYTES when ``on_line`` streams it). A node silent past node_timeout() (no
        output and no answer to a probe) ends the command with :class:`NodeLost`."""
        out = _Tail(keep if keep is not None or on_line is None else TAIL_BYTES)
        err = _Tail(TAIL_BYTES if on_line is not None else keep)
        lines = _Lines(self.node.rank, on_line) if on_line is not None else None

        def data(chunk: bytes) -> None:
            out.add(chunk)
            if lines is not None:
                lines.add(chunk)

        limit = node_timeout()
        try:
            code, why = self.exchange(command, stdin=stdin, on_data=data, on_err=err.add,
                                      combine=combine, timeout=timeout, stop=stop, limit=limit)
        except _Lost as exc:
            if lines is not None:
                lines.flush()
            return Result(self.node.rank, None, out.text(), err.text(),
                          NodeLost(self.node, float(exc.args[1]), limit, str(exc.args[0])))
        if lines is not None:
            lines.flush()
        if why:
            return Result(self.node.rank, None, out.text(), err.text(), RemoteError(why))
        return Result(self.node.rank, code, out.text(), err.text())

    def exchange(self, command: str, *, on_data: Callable[[bytes], None],
                 on_err: Callable[[bytes], None], stdin: bytes | None = None,
                 hold_stdin: bool = False, combine: bool = False, timeout: float | None = None,
                 stop: threading.Event | None = None,
                 limit: float = DEFAULT_NODE_TIMEOUT) -> tuple[int | None, str]:
        """The core of one command: returns (exit code, "") or (None, why it was cut short:
        stopped or timed out); raises _Lost(why, seconds silent) when the node is gone.
        ``hold_stdin``: keep the command's stdin open until the channel closes (a follower
        on the node ends when its session does)."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise _Lost("the SSH connection was closed", 0.0)
        try:
            chan = transport.open_session(timeout=limit)
        except Exception as exc:  # noqa: BLE001 - no channel: the connection is gone
            raise _Lost(f"no channel ({exc or type(exc).__name__})", limit) from None
        try:
            chan.set_combine_stderr(combine)
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
            if not hold_stdin:
                chan.shutdown_write()
            chan.settimeout(0.2)
            deadline = None if timeout is None else time.monotonic() + timeout
            contact = last_probe = time.monotonic()
            every = min(5.0, limit / 3)
            while True:
                if stop is not None and stop.is_set():
                    return None, "stopped"
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    return None, f"timed out after {timeout:.0f} s"
                got = False
                try:
                    chunk = chan.recv(65536)
                    if chunk:
                        got = True
                        on_data(chunk)
                except socket.timeout:
                    pass
                while chan.recv_stderr_ready():
                    got = True
                    on_err(chan.recv_stderr(65536))
                now = time.monotonic()
                if got:
                    contact = now
                elif chan.exit_status_ready() and not chan.recv_ready():
                    break
                elif now - contact >= every and now - last_probe >= every:
                    last_probe = now
                    if self.probe(limit - (now - contact)):
                        contact = time.monotonic()
                if time.monotonic() - contact > limit:
                    raise _Lost("it stopped answering", time.monotonic() - contact)
            while chan.recv_stderr_ready():
                on_err(chan.recv_stderr(65536))
            code = chan.recv_exit_status()
            if code == -1:   # closed without an exit status: the session or connection died
                raise _Lost("the SSH session was closed", time.monotonic() - contact)
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
        # Daemon threads, not the pool: on Ctrl-C the wait below ends at once, and a thread
        # still inside a TCP connect cannot hold the process up at exit.
        got: dict[int, Connection | BaseException] = {}
        lock = threading.Lock()
        all_in = threading.Event()

        def attempt(node: NodeRow) -> None:
            try:
                r: Connection | BaseException = one(node)
            except BaseException as exc:  # noqa: BLE001 - collected, then raised together
                r = exc
            with lock:
                if self.stop.is_set() and isinstance(r, Connection):
                    r.close()
                got[node.rank] = r
                if len(got) == len(todo):
                    all_in.set()

        for n in todo:
            threading.Thread(target=attempt, args=(n,), daemon=True,
                             name=f"ct-connect-{n.rank}").start()
        try:
            while todo and not all_in.wait(0.1):
                pass
        except KeyboardInterrupt:
            self.stop.set()
            raise
        errors: list[BaseException] = []
        for n in todo:
            r = got[n.rank]
            if isinstance(r, Connection):
                self.conns[n.rank] = r
            else:
                errors.append(r)
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
                conn = self.conns.get(node.rank)
                if conn is None:
                    raise RemoteError(f"no connection to node {node.rank} ({_address(node)}): it "
                                      "was lost earlier in this command.",
                                      "Check the node with 'cloudtrain status'.")
                res = conn.run(cmd, stdin=data, on_line=on_line, combine=combine,
                               timeout=timeout, stop=self.stop)
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                res = Result(node.rank, None, error=exc)
            return res

        return self._fan_out(one, wanted, on_done)

    def _fan_out(self, one: Callable[[NodeRow], Result], wanted: set[int],
                 on_done: Callable[[Result], None] | None) -> GroupResult:
        """``one`` on every node of ``wanted`` at once; ``on_done`` sees each result as it
        comes; the results are returned in rank order."""
        def each(node: NodeRow) -> Result:
            res = one(node)
            if on_done is not None:
                on_done(res)
            return res

        futures = {n.rank: self._pool.submit(each, n) for n in self.nodes if n.rank in wanted}
        out = GroupResult()
        for rank, fut in futures.items():
            out[rank] = fut.result()
        return out

    def follow(self, node: NodeRow, command: Callable[[int], str], on_line: LineSink,
               on_note: Callable[[str], None] | None = None) -> Result:
        """Follow a job that runs detached on ``node``: ``command(offset)`` streams its log
        from that byte and exits with the job's exit code. A dropped connection is
        reconnected (with backoff, until the node has been silent for node_timeout()) and the
        stream resumes at the byte it stopped at, so no line is lost or repeated. Only the
        job's own exit ends it; a node that does not come back ends it with NodeLost."""
        limit = node_timeout()
        lines = _Lines(node.rank, on_line)
        tail = _Tail(TAIL_BYTES)
        err = _Tail(TAIL_BYTES)
        offset = 0

        def data(chunk: bytes) -> None:
            nonlocal offset
            offset += len(chunk)
            tail.add(chunk)
            lines.add(chunk)

        def done(code: int | None, error: BaseException | None = None) -> Result:
            lines.flush()
            return Result(node.rank, code, tail.text(), err.text(), error)

        while True:
            if self.stop.is_set():
                return done(None, RemoteError("stopped"))
            conn = self.conns.get(node.rank)
            since = time.monotonic()
            try:
                if conn is None or not conn.active:
                    raise _Lost("the SSH connection was closed", 0.0)
                err.buf.clear()
                code, why = conn.exchange(command(offset), on_data=data, on_err=err.add,
                                          hold_stdin=True, stop=self.stop, limit=limit)
                if why:
                    return done(None, RemoteError(why))
                if code in (254, 255) and b"::ctjob " in err.buf:
                    if b"::ctjob no-job" in err.buf:
                        return done(None, RemoteError(f"node {node.rank}: the job is not there "
                                                      f"({err.text().strip()})"))
                    self.stop.wait(0.2)
                    continue   # the follower ended, the job still runs: follow again
                return done(code)
            except _Lost as exc:
                silent = float(exc.args[1])
                since = time.monotonic() - silent
                if on_note is not None:
                    on_note(f"node {node.rank} ({_address(node)}): {exc.args[0]}; reconnecting "
                            f"(gives up after {limit:.0f} s without an answer)")
            try:
                self._reconnect(node, deadline=since + limit)
            except (SSHTimeout, RemoteError) as exc:
                if self.stop.is_set():
                    return done(None, RemoteError("stopped"))
                if isinstance(exc, HostKeyMismatch):
                    return done(None, exc)
                return done(None, NodeLost(node, time.monotonic() - since, limit,
                                           "it did not accept a new SSH connection"))
            if on_note is not None:
                on_note(f"node {node.rank}: reconnected after {time.monotonic() - since:.1f} s; "
                        f"resuming its log at byte {offset}")

    def _reconnect(self, node: NodeRow, deadline: float) -> Connection:
        old = self.conns.pop(node.rank, None)
        if old is not None:
            old.close()
        conn = connect(node, self.keys, deadline=deadline, stop=self.stop)
        if self.stop.is_set():
            conn.close()
            raise RemoteError("stopped")
        self.conns[node.rank] = conn
        return conn

    def follow_all(self, command: Callable[[NodeRow, int], str], on_line: LineSink,
                   ranks: Iterable[int], on_done: Callable[[Result], None] | None = None,
                   on_note: Callable[[str], None] | None = None) -> GroupResult:
        """:meth:`follow` on every node of ``ranks`` at once."""
        wanted = set(ranks)

        def one(node: NodeRow) -> Result:
            try:
                return self.follow(node, lambda off: command(node, off), on_line, on_note)
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                return Result(node.rank, None, error=exc)

        return self._fan_out(one, wanted, on_done)

    def close(self) -> None:
        self.stop.set()
        for c in list(self.conns.values()):
            c.close()
        self.conns.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
