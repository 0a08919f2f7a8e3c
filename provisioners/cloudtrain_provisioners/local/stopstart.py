"""``cloudtrain stop`` on local nodes: each node's sshd and the cluster's processes on it end,
its folder stays; ``create_nodes`` starts the sshd again (``cloudtrain start``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cloudtrain.errors import ProviderError

from . import sshd


def stop_nodes(nodes_dir: Path, layout: dict[str, Any], patience: float = 10.0) -> None:
    """Stop every node of the layout; return once none of their sshd runs."""
    marker = str(layout["marker"])
    dirs = [nodes_dir / str(int(spec["rank"])) for spec in layout["nodes"]]
    left: list[int] = []
    for d in dirs:
        sshd.stop(d)
        left += sshd.kill_marked(marker, home=d / "root")
    deadline = time.monotonic() + patience
    while any(sshd.pid(d) is not None for d in dirs) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = [d.name for d in dirs if sshd.pid(d) is not None]
    if running or left:
        raise ProviderError(
            "local nodes did not stop: " + ", ".join(
                [f"node {r}'s sshd" for r in running] + [f"process {p}" for p in left]) + ".",
            "Run 'cloudtrain stop' again; if it persists, 'cloudtrain down' the cluster.")
