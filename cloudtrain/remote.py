"""SSH fan-out: one connection per node, reused within a command, commands run in parallel,
and one result per node kept whatever happens (fabric's GroupResult is the model). A job that
runs detached is followed node by node, reconnecting where a connection drops.

One connection to one node is ``openssh`` (over an OpenSSH master, multiplexed: the default)
or ``connection`` (paramiko; the shared types, the node timeout), where their names are
imported from.
"""

from __future__ import annotations

import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterable

from cloudtrain.connection import (TAIL_BYTES, ChannelLost, Exchange, LineBuffer, LineSink,
                                   NodeLost, Result, Tail, Transport, node_address, node_timeout)
from cloudtrain.errors import HostKeyMismatch, RemoteError, SSHTimeout
from cloudtrain.keys import ClusterKeys
from cloudtrain.openssh import connect

if TYPE_CHECKING:
    from cloudtrain.schema import NodeRow

__all__ = ["CommandFor", "Group", "GroupResult", "bash"]

CommandFor = Callable[["NodeRow"], str]


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
                parts.append(f"node {r.rank}: exit {r.exit_code}"
                             + (f" ({' | '.join(tail)})" if tail else ""))
        raise RemoteError(f"{what} failed on {len(bad)} of {len(self)} node(s): " + "; ".join(parts) + ".",
                          hint)


def bash(script: str) -> str:
    """Run ``script`` under bash whatever the login shell is."""
    return "bash -c " + shlex.quote(script)


class Group:
    """Connections to every node of a cluster, opened in parallel and reused."""

    def __init__(self, nodes: Iterable[NodeRow], keys: ClusterKeys) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.rank)
        self.keys = keys
        self.conns: dict[int, Transport] = {}
        self.stop = threading.Event()
        self.patience: float | None = None
        """How long :meth:`follow` keeps reconnecting to a silent node before NodeLost, when
        longer than node_timeout() (``launch --recover``: the unresponsive window)."""
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(64, len(self.nodes) * 2)),
                                        thread_name_prefix="ct-ssh")

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, timeout: float = 120.0, learn: frozenset[int] = frozenset()) -> Group:
        deadline = time.monotonic() + timeout

        def one(node: NodeRow) -> Transport:
            return connect(node, self.keys, deadline=deadline, learn=node.rank in learn,
                           stop=self.stop)

        todo = [n for n in self.nodes if n.rank not in self.conns]
        # Daemon threads, not the pool: on Ctrl-C the wait below ends at once, and a thread
        # still inside a TCP connect cannot hold the process up at exit.
        got: dict[int, Transport | BaseException] = {}
        lock = threading.Lock()
        all_in = threading.Event()

        def attempt(node: NodeRow) -> None:
            try:
                r: Transport | BaseException = one(node)
            except BaseException as exc:  # noqa: BLE001 - collected, then raised together
                r = exc
            with lock:
                if self.stop.is_set() and isinstance(r, Transport):
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
            if isinstance(r, Transport):
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
            on_done: Callable[[Result], None] | None = None,
            keep: int | None = None) -> GroupResult:
        """``keep``: the bytes of each node's stdout kept (Connection.run)."""
        wanted = set(ranks) if ranks is not None else {n.rank for n in self.nodes}

        def one(node: NodeRow) -> Result:
            try:
                cmd = command(node) if callable(command) else command
                data = stdin(node) if callable(stdin) else stdin
                res = self._conn(node).run(cmd, stdin=data, on_line=on_line, combine=combine,
                                           timeout=timeout, stop=self.stop, keep=keep)
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                res = Result(node.rank, None, error=exc)
            return res

        return self._fan_out(one, wanted, on_done)

    def run_to_end(self, command: CommandFor, timeout: float) -> GroupResult:
        """``command`` on every node, not cut short by the group's stop (which ends the
        follows of a job being stopped): the stop of the job's processes runs to its end."""
        def one(node: NodeRow) -> Result:
            try:
                return self._conn(node).run(command(node), timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                return Result(node.rank, None, error=exc)

        return self._fan_out(one, {n.rank for n in self.nodes}, None)

    def _conn(self, node: NodeRow) -> Transport:
        conn = self.conns.get(node.rank)
        if conn is None:
            raise RemoteError(f"no connection to node {node.rank} ({node_address(node)}): it "
                              "was lost earlier in this command.",
                              "Check the node with 'cloudtrain status'.")
        return conn

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
               on_note: Callable[[str], None] | None = None, stdin: bytes | None = None) -> Result:
        """Follow a job that runs detached on ``node``: ``command(offset)`` streams its log
        from that byte and exits with the job's exit code. A dropped connection is
        reconnected (with backoff, until the node has been silent for node_timeout(), or
        ``patience`` when that is longer) and the
        stream resumes at the byte it stopped at, so no line is lost or repeated. Only the
        job's own exit ends it; a node that does not come back ends it with NodeLost.
        ``stdin``: bytes sent first on every attempt (stdin is then held open as always)."""
        limit = node_timeout()
        patience = max(limit, self.patience or 0.0)
        lines = LineBuffer(node.rank, on_line)
        tail = Tail(TAIL_BYTES)
        err = Tail(TAIL_BYTES)
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
                    raise ChannelLost("the SSH connection was closed", 0.0)
                err.buf.clear()
                code, why = conn.exchange(command(offset), on_data=data, on_err=err.add,
                                          how=Exchange(stdin=stdin, hold_stdin=True,
                                                       stop=self.stop, limit=limit))
                if why:
                    return done(None, RemoteError(why))
                if code in (254, 255) and b"::ctjob " in err.buf:
                    if b"::ctjob no-job" in err.buf:
                        return done(None, RemoteError(f"node {node.rank}: the job is not there "
                                                      f"({err.text().strip()})"))
                    self.stop.wait(0.2)
                    continue   # the follower ended, the job still runs: follow again
                return done(code)
            except ChannelLost as exc:
                silent = float(exc.args[1])
                since = time.monotonic() - silent
                if on_note is not None:
                    on_note(f"node {node.rank} ({node_address(node)}): {exc.args[0]}; reconnecting "
                            f"(gives up after {patience:.0f} s without an answer)")
            try:
                self._reconnect(node, deadline=since + patience)
            except (SSHTimeout, RemoteError) as exc:
                if self.stop.is_set():
                    return done(None, RemoteError("stopped"))
                if isinstance(exc, HostKeyMismatch):
                    return done(None, exc)
                return done(None, NodeLost(node, time.monotonic() - since, patience,
                                           "it did not accept a new SSH connection"))
            if on_note is not None:
                on_note(f"node {node.rank}: reconnected after {time.monotonic() - since:.1f} s; "
                        f"resuming its log at byte {offset}")

    def _reconnect(self, node: NodeRow, deadline: float) -> Transport:
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
                   on_note: Callable[[str], None] | None = None,
                   stdin: Callable[[NodeRow], bytes] | None = None) -> GroupResult:
        """:meth:`follow` on every node of ``ranks`` at once (``stdin``: each node's bytes)."""
        wanted = set(ranks)

        def one(node: NodeRow) -> Result:
            try:
                return self.follow(node, lambda off: command(node, off), on_line, on_note,
                                   stdin=None if stdin is None else stdin(node))
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                return Result(node.rank, None, error=exc)

        return self._fan_out(one, wanted, on_done)

    def close(self) -> None:
        self.stop.set()
        for c in list(self.conns.values()):
            c.close()
        self.conns.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
