"""How a command stops: SIGTERM and SIGHUP (the terminal was closed) are handled like Ctrl-C
(exit 130, after the same cleanup: the job stopped on every node, outputs pulled back where
possible, --down tearing down), and a teardown or rollback runs :class:`Shielded` from them
so that it is not cut off half-way."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# The signals that stop a command the way Ctrl-C does.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def silence_lost_terminal() -> None:
    """After SIGHUP the terminal is gone and writing to it fails (EIO), which would abort the
    cleanup half-way: what would have gone to it goes to /dev/null (the logs keep it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if os.isatty(fd):
                    os.dup2(devnull, fd)
            except OSError:
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def stop_signals_as_interrupt() -> None:
    """SIGTERM and SIGHUP (the terminal was closed) are handled like Ctrl-C."""
    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            silence_lost_terminal()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


class Shielded:
    """While inside, SIGINT/SIGTERM/SIGHUP are ignored: a teardown or rollback is not cut off
    half-way (a SIGHUP still silences the lost terminal). Outside the main thread, where
    signals are neither delivered nor handled, it does nothing."""

    def __enter__(self) -> None:
        def on_hup(signum: int, frame: object) -> None:
            silence_lost_terminal()

        self.previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        self.previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, on_hup if s == signal.SIGHUP else signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)
