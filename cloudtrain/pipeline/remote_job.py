"""One script on every node at once: started detached (it outlives the SSH connection),
followed through each node's log (a dropped connection is resumed, not an exit), stopped on
every node when one fails or on Ctrl-C; the sink that writes each node's lines to its local
log file and the terminal. Used by ``run`` (launch, exec) and ``logs``."""

from __future__ import annotations

import secrets
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping, Protocol, Sequence, TextIO

from cloudtrain import paths
from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import Interrupted
from cloudtrain.pipeline import bootstrap, ranklog
from cloudtrain.pipeline.teardown import stop_processes
from cloudtrain.remote import Group, bash
from cloudtrain.connection import NodeLost, Result
from cloudtrain.schema import NodeRow

# Seconds from SIGTERM to SIGKILL when a job is stopped, unless the task sets stop_grace.
STOP_GRACE: float = 60


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def job_dir(node: NodeRow, job_id: str) -> str:
    return str(PurePosixPath(node.root_dir) / "jobs" / job_id)


# --- the log sink ----------------------------------------------------------------------------

class LogSink:
    """Writes each node's lines to its local log file and to the terminal."""

    def __init__(self, env: Env, folder: Path, suffix: str, echo: bool, raw: bool = False) -> None:
        self.env = env
        self.raw = raw
        self.folder = folder
        paths.private_dir(folder)
        self.suffix = suffix
        self.show = echo
        self.files: dict[int, TextIO] = {}
        self.lock = threading.Lock()

    def __call__(self, rank: int, line: str) -> None:
        line = ranklog.strip(line)   # torchrun's rank prefix (a train job's lines)
        self.write(rank, line)
        self.echo(rank, line)

    def write(self, rank: int, line: str) -> None:
        """To node ``rank``'s local log file only."""
        with self.lock:
            f = self.files.get(rank)
            if f is None:
                f = self.files[rank] = open(self.folder / f"node-{rank}{self.suffix}.log", "a",
                                                 opener=paths.private_opener)
            f.write(line + "\n")
            f.flush()

    def echo(self, rank: int, line: str) -> None:
        """To the terminal only (when this sink echoes)."""
        if self.show:
            if self.raw:
                self.env.ui.raw_line(line)
            else:
                self.env.ui.node_line(rank, line)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


# --- the job on every node --------------------------------------------------------------------

def start_command(jdir: str, detach: bool) -> str:
    """ctjob.sh travels inline, so a job (or exec) needs nothing uploaded beforehand."""
    return bootstrap.inline("ctjob.sh", jdir, *(["--detach"] if detach else []))


def _py(python_bin: str | None) -> str:
    """Where the follower finds a Python first (the one bootstrap found on the node)."""
    return f"CT_PYTHON_BIN={shlex.quote(python_bin)} " if python_bin else ""


def follow_command(jdir: str, offset: int, python_bin: str | None = None) -> str:
    """Stream a started job's node.log from byte ``offset``; exits with the job's exit code."""
    return _py(python_bin) + bootstrap.inline("ctjob.sh", jdir, "--follow", str(offset))


def run_command(jdir: str, offset: int, python_bin: str | None = None) -> str:
    """Start the job (once) and follow it from ``offset`` in one session: see framed()."""
    return _py(python_bin) + bootstrap.inline("ctjob.sh", jdir, "--run", str(offset))


def framed(script: str) -> bytes:
    """The job script as ``--run`` reads it on stdin: its length, a newline, the script."""
    data = script.encode()
    return str(len(data)).encode() + b"\n" + data


# A command run before the job's in the same session, and the bytes it reads on stdin (the
# node guard's lease renewal on exec): (command, stdin).
Before = Callable[[NodeRow], "tuple[str, bytes]"]


class Turn(Protocol):
    """A job's turn in the cluster's queue (implemented by cloudtrain/pipeline/queue.py)."""

    def command(self, node: NodeRow) -> str: ...
    def run_command(self, node: NodeRow, offset: int) -> str: ...
    def wait(self, res: Mapping[int, Result], detach: bool) -> None: ...
    def queued_on(self, res: Result) -> bool: ...
    def wait_node(self, res: Result) -> None: ...
    def withdraw(self) -> None: ...


@dataclass(frozen=True)
class JobParts:
    """What a :class:`RemoteJob` runs: one script per node, where its lines go, on which
    ranks, and how it is stopped."""

    job_id: str
    scripts: Mapping[int, str]
    sink: Callable[[int, str], None]
    ranks: Sequence[int]
    stop_on_failure: bool = True
    """Stop every node's part when one fails (not for exec)."""
    grace: float = STOP_GRACE
    turn: Turn | None = None
    """The job's turn in the cluster's queue (pipeline/queue.py)."""
    before: Before | None = None
    """Run first, in the same session as the job's start."""
    on_failure: Callable[[int], str | None] | None = None
    """Called with the node's rank as soon as a node's part ends non-zero (the failure
    report's sink goes quiet); returns who failed, in words, when it knows better."""


class RemoteJob:
    """One script on every node at once, stopped everywhere when one node fails."""

    def __init__(self, env: Env, handle: Handle, group: Group, parts: JobParts) -> None:
        self.env, self.handle, self.group = env, handle, group
        self.before = parts.before
        self.turn = parts.turn
        self.grace = parts.grace
        self.stop_on_failure = parts.stop_on_failure
        self.job_id = parts.job_id
        self.scripts = parts.scripts
        self.sink = parts.sink
        self.on_failure = parts.on_failure
        self.ranks = list(parts.ranks)
        self.order: list[tuple[int, int | None, float]] = []
        self.errors: dict[int, BaseException] = {}
        self.stopping = threading.Event()
        self._stopper: threading.Thread | None = None
        self.lock = threading.Lock()
        self._last_stop = 0.0
        self.cancelled: BaseException | None = None   # a queued part cancelled before its turn

    def _jdirs(self) -> dict[int, str]:
        return {n.rank: job_dir(n, self.job_id) for n in self.handle.nodes}

    def _stop(self) -> None:
        # Each node's processes by that node's job directory (CLOUDTRAIN_JOB_DIR): nodes that
        # share a machine (local ones) must not signal each other's job, or a node's job could
        # lose its child before it gets SIGTERM itself and never run its checkpoint trap.
        jdirs = self._jdirs()
        stop_processes(self.env, self.handle, f"CLOUDTRAIN_JOB_ID={self.job_id}", jdirs,
                       grace=self.grace, group=self.group,
                       node_markers={r: f"CLOUDTRAIN_JOB_DIR={d}" for r, d in jdirs.items()})

    def stop_everywhere(self, reason: str) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.env.ui.warn(f"{reason} (SIGTERM, then SIGKILL after {self.grace:g} s: stop_grace)")
        self._last_stop = time.monotonic()
        self._stop()

    def stop_for_budget(self, reason: str) -> None:
        """Called by the budget watch at 100 %, and again on its later polls while this job
        still runs: a node whose job started just after the first stop is stopped too."""
        if not self.stopping.is_set():
            self._user_stop()
            self.stop_everywhere(f"{reason}: stopping job {self.job_id} on every node")
        elif time.monotonic() - self._last_stop >= 1.0:
            self._last_stop = time.monotonic()
            self._stop()

    def _user_stop(self) -> None:
        """The job is stopped on purpose: a sink that holds lines back shows them all."""
        stopped = getattr(self.sink, "stopped", None)
        if callable(stopped):
            stopped()

    def _on_done(self, r: Result) -> None:
        code = r.exit_code if r.error is None else None
        with self.lock:
            self.order.append((r.rank, code, time.time()))
            if r.error is not None:
                self.errors[r.rank] = r.error
        said = self.on_failure(r.rank) if code != 0 and self.on_failure is not None else None
        if code != 0 and self.stop_on_failure and not self.stopping.is_set():
            # No exit code here: a node's (torchrun says 1) is not the job's; the report
            # that follows names the one code the command exits with.
            what = (f"{said or f'node {r.rank}'} failed" if code is not None
                    else f"node {r.rank} lost ({getattr(r.error, 'message', r.error)})")
            t = threading.Thread(target=self.stop_everywhere, daemon=True,
                                 args=(f"{what}: stopping the job on every node",))
            self._stopper = t
            t.start()

    def run(self, detach: bool = False) -> dict[int, Result]:
        """Start the job on every node, detached (it outlives the connection); unless
        ``detach``, start and follow each node's log in one session per node until the job
        ends there: a dropped connection is resumed, not an exit (nor a second start)."""
        jdirs = self._jdirs()
        res: dict[int, Result]
        try:
            if detach:
                res = self.group.run(self.turn.command if self.turn else
                                     lambda n: start_command(jdirs[n.rank], True),
                                     stdin=lambda n: self.scripts[n.rank].encode(),
                                     combine=True, ranks=self.ranks)
                if self.turn is not None:
                    self.turn.wait(res, detach)
            else:
                res = self._each(lambda n: self._start_and_follow(n, jdirs[n.rank]))
        except KeyboardInterrupt:
            self.env.ui.warn("Interrupted: stopping the job on every node...")
            self._user_stop()
            try:
                if self.turn is not None:
                    self.turn.withdraw()    # a queued job never starts
                self.stop_everywhere("Interrupted")
            except KeyboardInterrupt:
                self.stop_everywhere("Interrupted")
            raise Interrupted("Interrupted; the job was stopped on every node.") from None
        if self._stopper is not None:
            self._stopper.join()
        if self.cancelled is not None:
            raise self.cancelled
        return res

    def _start_and_follow(self, node: NodeRow, jdir: str) -> Result:
        """One session: (``before``), the start (through the queue with a turn), the follow."""
        stdin = framed(self.scripts[node.rank])
        turn = self.turn
        if turn is not None:
            def command(off: int) -> str:
                return turn.run_command(node, off)
        elif self.before is not None:
            first, data = self.before(node)
            stdin = data + stdin
            command = lambda off: bash(  # noqa: E731 - a named one-line callable, read once below
                f"head -c {len(data)} | {{ {first} >&2; cat > /dev/null; }}; "
                + run_command(jdir, off, node.python_bin))
        else:
            command = lambda off: run_command(jdir, off, node.python_bin)  # noqa: E731 - a named one-line callable, read once below
        r = self.group.follow(node, command, self.sink, self.env.ui.warn, stdin=stdin)
        if turn is not None and turn.queued_on(r):
            try:
                turn.wait_node(r)   # its turn comes on the node (no CLI needed for that)
            except Exception as exc:  # noqa: BLE001 - raised by run() once every node is done
                self.cancelled = exc
                return Result(node.rank, 1, "", "", None)
            r = self.group.follow(node, lambda off: follow_command(jdir, off, node.python_bin),
                                  self.sink, self.env.ui.warn)
        self._on_done(r)
        return r

    def _each(self, one: Callable[[NodeRow], Result]) -> dict[int, Result]:
        """``one`` on every node of ``self.ranks`` at once, in daemon threads (Ctrl-C ends the
        wait at once); the results in rank order."""
        nodes = [n for n in self.handle.nodes if n.rank in set(self.ranks)]
        got: dict[int, Result] = {}
        all_in = threading.Event()

        def go(node: NodeRow) -> None:
            try:
                r = one(node)
            except BaseException as exc:  # noqa: BLE001 - every node's outcome is kept
                r = Result(node.rank, None, error=exc)
            with self.lock:
                got[node.rank] = r
                if len(got) == len(nodes):
                    all_in.set()

        for n in nodes:
            threading.Thread(target=go, args=(n,), daemon=True, name=f"ct-job-{n.rank}").start()
        while nodes and not all_in.wait(0.1):
            pass
        return {r: got[r] for r in sorted(got)}

    def lost(self) -> NodeLost | None:
        """The lost-node error of the node that failed first, when it was lost (not exited)."""
        first = self.first_failure()
        if first is None or first[1] is not None:
            return None
        err = self.errors.get(first[0])
        return err if isinstance(err, NodeLost) else None

    def first_failure(self) -> tuple[int, int | None] | None:
        for rank, code, _ in sorted(self.order, key=lambda x: x[2]):
            if code != 0:
                return rank, code
        return None


@dataclass(frozen=True)
class WorkerFailure:
    """The worker that failed first, as its wrapper (bootstrap/ctworker.sh) recorded it."""

    node: int
    rank: int
    code: int
    local_rank: int | None


def read_worker_failures(group: Group, handle: Handle, job_id: str) -> WorkerFailure | None:
    """The worker that failed first, across nodes."""
    res = group.run(lambda n: bash(
        f"cat {shlex.quote(job_dir(n, job_id))}/worker-failures 2>/dev/null; true"))
    best: tuple[float, WorkerFailure] | None = None
    for rank, r in res.items():
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) not in (3, 4):   # 3: written by an older ctworker.sh
                continue
            try:
                grank, code, ts = int(parts[0]), int(parts[1]), float(parts[2])
            except ValueError:
                continue
            local = int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else None
            if best is None or ts < best[0]:
                best = (ts, WorkerFailure(rank, grank, code, local))
    return None if best is None else best[1]
