"""A ``train:`` job's lines by rank, and what the terminal shows of them.

torchrun tees every worker's output to the node's log with the prefix set by
:data:`cloudtrain.pipeline.torchrun.PREFIX_TEMPLATE` (global and local rank); the prefix is
taken off before a line is written or shown, so a job's output reads as the workers wrote it.
Each rank's last lines are kept for the failure report.

The terminal, unless ``-v``: lines are shown live, a moment late (:data:`HOLD` seconds), so
that when a worker fails (its wrapper, bootstrap/ctworker.sh, writes ``::ctworker exit RC``
in its own stream, or a node exits non-zero) the lines not yet shown - every rank's echo of the
same error, torchrun's tracebacks - go to the log files only, and the report names the failing
rank with its own last lines once. A job that succeeds shows every line, as with ``-v``."""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Inner(Protocol):
    """Where the lines go (remote_job.LogSink): the node's log file, the terminal."""

    def write(self, rank: int, line: str) -> None: ...
    def echo(self, rank: int, line: str) -> None: ...
    def close(self) -> None: ...

# Seconds a line waits before it is shown (not with -v): a failing worker's marker arrives
# within a second or two of its last lines (its process exits first), and with it the other
# ranks' echoes are held back. Lines from the job's first START seconds wait until then: a job
# that fails at its start (a bad flag, an import error) does so on every rank at once, and a
# loaded machine takes seconds to end a process that imported torch.
HOLD: float = 2.0
START: float = 10.0
# Lines of the failing rank's own output in the failure report.
TAIL = 6

_PREFIX = re.compile(r"^\[ct-rank (\d+) (\d+)\] ")
MARKER = "::ctworker exit "


@dataclass(frozen=True)
class Line:
    text: str
    rank: int | None = None
    """The worker's global rank (None: torchrun's own line, or no prefix)."""
    local_rank: int | None = None


def parse(line: str) -> Line:
    m = _PREFIX.match(line)
    if m is None:
        return Line(line)
    return Line(line[m.end():], int(m.group(1)), int(m.group(2)))


def strip(line: str) -> str:
    return parse(line).text


@dataclass(frozen=True)
class Failed:
    """The worker that failed first, as the report names it."""

    node: int
    rank: int | None
    local_rank: int | None
    code: int
    last: tuple[str, ...] = ()


class RankSink:
    """The sink of a train job's lines: every line to its node's log file at once; to the
    terminal live with ``verbose``, else :data:`HOLD` seconds late and not at all once a
    worker has failed (``watch_markers``: a worker's own failure counts, not only a node's;
    off when torchrun restarts failed workers)."""

    def __init__(self, inner: Inner, verbose: bool, watch_markers: bool = True,
                 hold: float = HOLD, start: float = START) -> None:
        self.inner, self.verbose, self.hold, self.start = inner, verbose, hold, start
        self.t0: float | None = None   # the job's first line
        self.watch_markers = watch_markers
        self.lock = threading.Lock()
        self.held: deque[tuple[float, int, str]] = deque()
        self.lines: dict[tuple[int, int], deque[str]] = {}
        self.locals: dict[tuple[int, int], int] = {}
        self.first: tuple[int, int, int] | None = None   # (node, rank, code) by marker
        self.failed = threading.Event()
        self.user_stop = threading.Event()   # stopped by the user or the budget: show all
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        if not verbose:
            self.thread = threading.Thread(target=self._show_due, daemon=True, name="ct-hold")
            self.thread.start()

    def __call__(self, node: int, raw: str) -> None:
        line = parse(raw)
        marker = line.rank is not None and line.text.startswith(MARKER)
        if line.rank is not None and not marker:
            key = (node, line.rank)
            with self.lock:
                self.lines.setdefault(key, deque(maxlen=TAIL)).append(line.text)
                if line.local_rank is not None:
                    self.locals[key] = line.local_rank
        self.inner.write(node, line.text)
        if marker:
            self._marker(node, line)
            return
        if self.verbose or self.user_stop.is_set():
            self.inner.echo(node, line.text)
            return
        now = time.monotonic()
        with self.lock:
            if self.t0 is None:
                self.t0 = now
            if not self.failed.is_set():
                self.held.append((max(now, self.t0 + self.start - self.hold), node, line.text))

    def _marker(self, node: int, line: Line) -> None:
        code = line.text[len(MARKER):].strip()
        with self.lock:
            if self.first is None and line.rank is not None and code.isdigit():
                self.first = (node, line.rank, int(code))
                if line.local_rank is not None:
                    self.locals[(node, line.rank)] = line.local_rank
        if self.watch_markers and not self.user_stop.is_set():
            self.fail()

    def fail(self, node: int | None = None) -> str | None:
        """A worker or node failed: what is not shown yet stays in the log files only.
        Returns who failed first, in words, when a worker said so."""
        with self.lock:
            self.failed.set()
            self.held.clear()
            first = self.first
        if first is None:
            return None
        return who(Failed(first[0], first[1], self.locals.get(first[:2]), first[2]))

    def stopped(self) -> None:
        """The user (Ctrl-C) or the budget stops the job: the workers end on a signal, which
        is not a failure to hide output for. What is held is shown now, and every later line
        (the checkpoint each rank writes and uploads on SIGTERM) as it comes."""
        self.user_stop.set()
        if not self.failed.is_set():
            self._show(float("inf"))

    def _show_due(self) -> None:
        while not self.done.wait(0.1):
            self._show(time.monotonic() - self.hold)

    def _show(self, before: float) -> None:
        while True:
            with self.lock:
                if not self.held or self.held[0][0] > before:
                    return
                _, node, text = self.held.popleft()
            self.inner.echo(node, text)

    def close(self) -> None:
        """The job ended: what is held is shown (unless a worker failed), the files closed."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        self._show(float("inf"))
        self.inner.close()

    def failure(self, node: int, rank: int | None, code: int,
                local_rank: int | None = None) -> Failed:
        """The report's record of the worker that failed first (as the nodes recorded it),
        with its own last lines."""
        with self.lock:
            if self.first is not None and self.watch_markers:   # the first one the CLI heard of
                node, rank, code = self.first
                local_rank = None
            key = (node, rank) if rank is not None else None
            last = tuple(self.lines.get(key, ())) if key else ()
            if local_rank is None and key is not None:
                local_rank = self.locals.get(key)
        return Failed(node, rank, local_rank, code, last)


def who(failed: Failed) -> str:
    """'rank 2 (node 1, local rank 0)', or 'node 1' when the rank is not known."""
    if failed.rank is None:
        return f"node {failed.node}"
    local = f", local rank {failed.local_rank}" if failed.local_rank is not None else ""
    return f"rank {failed.rank} (node {failed.node}{local})"


def message(failed: Failed) -> str:
    """The report's first line and the failing rank's own last lines."""
    others = "ranks" if failed.rank is not None else "nodes"
    head = f"The job failed: {who(failed)} exited with code {failed.code}; the other {others} " \
           "were stopped."
    if not failed.last:
        return head
    return "\n".join([head + " Its last lines:", *(f"  | {ln}" for ln in failed.last)])


def where(name: str, node: int | None, logs: Path | None, ranks: bool = True) -> str:
    """Where the full logs are: the local file, and the command that shows them (``ranks``:
    a train job, whose every rank's output ``launch -v`` shows live)."""
    n = 0 if node is None else node
    local = f"{logs / f'node-{n}.log'}, or " if logs is not None else ""
    return (f"Full logs: {local}'cloudtrain logs {name} --node {n}'"
            + ("; every rank's output live: launch -v." if ranks else "."))
