"""``cloudtrain top``: the nodes' GPU use, live. One SSH connection per node is opened once
and every refresh runs the same single command per node as ``status --refresh`` (the guard's
state and the nvidia-smi query, :func:`cloudtrain.pipeline.guard.states`) over it. rich is
imported here, only when ``top`` runs."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from cloudtrain.context import Env
from cloudtrain.gpuuse import IDLE_RULE, NodeGPUs, node_line

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.remote import Group


def snapshot(env: Env, handle: Handle, group: Group) -> list[NodeGPUs]:
    """Every node's GPUs now, in rank order (one command per node)."""
    from cloudtrain.pipeline import guard as node_guard

    return node_guard.states(env, handle, group, gpus=True).gpus or []


def _cell(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render(name: str, nodes: list[NodeGPUs], took_s: float) -> Any:
    """One frame: a row per GPU (a row per node that has none), and a line per node."""
    from rich.console import Group as Lines
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, title_justify="left",
                  title=f"{name}: GPU use at {time.strftime('%H:%M:%S')} "
                        f"(query {took_s:.2f} s; Ctrl-C to quit)")
    for col in ("NODE", "GPU", "MODEL", "UTIL %", "MEM USED/TOTAL MiB", "TEMP C", "POWER W",
                "NOTE"):
        table.add_column(col, justify="right" if col[0] in "UMTP" else "left")
    for n in nodes:
        if not n.gpus:
            table.add_row(str(n.rank), "-", "no GPU" if n.state == "no-gpu" else "?", "", "", "",
                          "", n.detail)
            continue
        for g in n.gpus:
            mem = f"{_cell(g.mem_used_mib, '.0f')}/{_cell(g.mem_total_mib, '.0f')}"
            power = _cell(g.power_w, ".0f") + (f"/{g.power_limit_w:.0f}" if g.power_limit_w else "")
            table.add_row(str(n.rank), g.index, g.name, _cell(g.util_pct, ".0f"), mem,
                          _cell(g.temp_c, ".0f"), power, "IDLE" if g.idle else "")
    lines = [Text(node_line(n)) for n in nodes]
    if any(n.idle for n in nodes):
        lines.append(Text(f"IDLE = {IDLE_RULE}"))
    return Lines(table, Text(""), *lines)


def top(env: Env, name: str, interval: float, once: bool) -> None:
    """Show the frame once, or refresh it every ``interval`` seconds until Ctrl-C (in place on
    a terminal, one frame after the other otherwise); the connections are closed either way."""
    from rich.console import Console
    from rich.live import Live

    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt
    from cloudtrain.ui import color_ok

    stop_signals_as_interrupt()       # Ctrl-C, SIGTERM, SIGHUP: close and exit 0
    handle = get_handle(env, name)
    tty = color_ok(sys.stdout)
    console = Console(no_color=not tty, highlight=False, color_system="auto" if tty else None,
                      width=None if sys.stdout.isatty() else 160)
    group = connect(env, handle, timeout=30)
    try:
        t0 = time.monotonic()
        frame = render(name, snapshot(env, handle, group), time.monotonic() - t0)
        if once or not console.is_terminal:
            console.print(frame)      # not a terminal (a log, a pipe): one frame a refresh
        if once:
            return
        if not console.is_terminal:
            while True:
                time.sleep(interval)
                t0 = time.monotonic()
                console.print(render(name, snapshot(env, handle, group), time.monotonic() - t0))
        with Live(frame, console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                t0 = time.monotonic()
                live.update(render(name, snapshot(env, handle, group), time.monotonic() - t0),
                            refresh=True)
    except KeyboardInterrupt:
        return
    finally:
        group.close()
