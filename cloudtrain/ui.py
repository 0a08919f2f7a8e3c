"""Terminal output: progress and messages on stderr, job logs on stdout prefixed by node.

No colour codes when the stream is not a terminal or ``NO_COLOR`` is set."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import AbstractContextManager
from typing import IO, TYPE_CHECKING, Collection, TextIO

if TYPE_CHECKING:
    from rich.console import Console

_COLORS = ["cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_cyan",
           "bright_magenta"]


def color_ok(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class UI:
    def __init__(self, quiet: bool = False, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.quiet = quiet
        self.verbose = False   # launch -v: every rank's output live, tracebacks too
        self.out = out or sys.stdout
        self.err_stream = err or sys.stderr
        self.color = color_ok(self.err_stream)
        self.out_color = color_ok(self.out)
        self._console: Console | None = None
        self._lock = threading.Lock()

    @property
    def console(self) -> Console:
        """rich's console on stderr, made at the first message (a command that prints none,
        a plain ``status``, never imports rich)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.err_stream, no_color=not self.color,
                                    color_system="auto" if self.color else None,
                                    highlight=False, soft_wrap=True, force_terminal=self.color)
        return self._console

    # --- messages (stderr) -----------------------------------------------------------------

    def _say(self, mark: str, style: str, msg: str) -> None:
        """``mark msg`` on stderr: through rich where there is colour, else written as is (the
        same text, without importing rich)."""
        with self._lock:
            if not self.color:
                self.err_stream.write(f"{mark} {msg}\n" if mark else f"{msg}\n")
                self.err_stream.flush()
            elif mark:
                self.console.print(f"[{style}]{mark}[/{style}] {_esc(msg)}")
            else:
                self.console.print(msg, markup=False)

    def info(self, msg: str) -> None:
        if not self.quiet:
            self._say("", "", msg)

    def step(self, msg: str) -> None:
        if not self.quiet:
            self._say("»", "bold", msg)

    def ok(self, msg: str) -> None:
        if not self.quiet:
            self._say("✓", "green", msg)

    def warn(self, msg: str) -> None:
        self._say("!", "yellow", msg)

    def error(self, msg: str) -> None:
        self._say("error:", "bold red", msg)

    def status(self, msg: str) -> AbstractContextManager[object]:
        """A spinner while something runs (only on a terminal)."""
        from contextlib import nullcontext

        if self.quiet or not self.color:
            if not self.quiet:
                self.step(msg)
            return nullcontext()
        return self.console.status(_esc(msg))

    # --- job output (stdout) ---------------------------------------------------------------

    def raw_line(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()

    def node_line(self, rank: int, line: str) -> None:
        if self.out_color:
            code = 36 + (rank % 2) if rank < 2 else 31 + (rank % 6)
            prefix = f"\x1b[{code}m(node-{rank})\x1b[0m "
        else:
            prefix = f"(node-{rank}) "
        with self._lock:
            self.out.write(prefix + line + "\n")
            self.out.flush()


def _esc(s: str) -> str:
    from rich.markup import escape

    return escape(s)


def columns(headers: list[str], rows: list[list[str]], right: Collection[str] = (),
            gap: str = "  ") -> str:
    """A plain text table: one line per row, columns padded to their widest cell (the
    ``right`` ones aligned right). No rich: for commands that must start fast."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return gap.join(c.rjust(w) if h in right else c.ljust(w)
                        for c, w, h in zip(cells, widths, headers)).rstrip()
    return "\n".join([line(headers)] + [line(r) for r in rows])
