"""Detached recovery controllers (``launch -d --recover``, ``cloudtrain jobs``): a background
process on this machine that runs :func:`cloudtrain.pipeline.job.launch` (``--recover``), with its record
and log under ``CLOUDTRAIN_HOME/jobs/<id>/`` (controller.json, controller.log). The record's
``state``: running, succeeded, failed, cancelled; a record still "running" whose process is
gone reads as controller-died (the nodes' guards then apply the launch's policy)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudtrain import paths
from cloudtrain.errors import UserError

if TYPE_CHECKING:
    from cloudtrain.pipeline.request import Launch

ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")
FINAL = ("succeeded", "failed", "cancelled")


def jobs_dir() -> Path:
    return paths.private_dir(paths.home() / "jobs")


def check_id(cid: str) -> Path:
    """The folder of controller ``cid``; a malformed or unknown id is refused (exit 2)."""
    if not ID_RE.match(cid):
        raise UserError(f"'{cid}' is not a controller id (they look like 20261124-030512-a1b2c3).",
                        "See the ids with 'cloudtrain jobs'.")
    d = jobs_dir() / cid
    if not (d / "controller.json").exists():
        raise UserError(f"There is no controller '{cid}'.", "See the ids with 'cloudtrain jobs'.")
    return d


def read(d: Path) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads((d / "controller.json").read_text())
    if rec.get("state") == "running" and not alive(rec.get("pid")):
        rec["state"] = "controller-died"
    return rec


def write(d: Path, rec: dict[str, Any]) -> None:
    tmp = d / "controller.json.tmp"
    with open(tmp, "w", opener=paths.private_opener) as f:
        json.dump(rec, f, indent=1)
    tmp.replace(d / "controller.json")


def alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def listing() -> list[dict[str, Any]]:
    out = []
    for d in sorted(jobs_dir().iterdir()):
        if ID_RE.match(d.name) and (d / "controller.json").exists():
            try:
                out.append(read(d))
            except (OSError, ValueError):
                continue
    return out


def spawn(req: Launch) -> dict[str, Any]:
    """Start the controller for ``req`` in the background (its own session: it outlives the
    terminal). Its record keeps the command line it resolves again (controller_main.py)."""
    from cloudtrain.pipeline.remote_job import new_job_id

    assert req.command_line is not None, "a background controller needs the command line"
    line = req.command_line
    cid = new_job_id()
    d = paths.private_dir(jobs_dir() / cid)
    rec: dict[str, Any] = {
        "id": cid, "cluster": req.name, "task_file": str(Path(line.task_file).resolve()),
        "cwd": os.getcwd(), "down_after": req.down_after, "overrides": dict(req.overrides),
        "max_cost": line.max_cost, "hours": line.hours, "no_budget": req.no_budget,
        "state": "running", "started_at": time.time(), "ended_at": None, "exit_code": None,
        "error": None, "pid": None,
    }
    write(d, rec)
    log = open(d / "controller.log", "a", opener=paths.private_opener)
    proc = subprocess.Popen([sys.executable, "-m", "cloudtrain.pipeline.controller_main", cid],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=rec["cwd"],
                            env={**os.environ, "CLOUDTRAIN_HOME": str(paths.home())})
    log.close()
    rec["pid"] = proc.pid
    write(d, rec)
    return rec


def cancel(cid: str, wait: float = 120.0) -> dict[str, Any]:
    """Stop the controller (SIGTERM: it stops the job on every node with stop_grace, and tears
    down with --down) and wait for its final state."""
    d = check_id(cid)
    rec = read(d)
    if rec["state"] != "running":
        return rec
    (d / "cancel-requested").touch()
    os.kill(int(rec["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and alive(rec["pid"]):
        time.sleep(0.2)
    return read(d)


def follow(cid: str, out: Any, keep: bool) -> None:
    """Print the controller's log; with ``keep``, go on until the controller has ended."""
    d = check_id(cid)
    with open(d / "controller.log", "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                out.write(chunk.decode(errors="replace"))
                out.flush()
                continue
            if not keep or read(d)["state"] != "running":
                rest = f.read()
                if rest:
                    out.write(rest.decode(errors="replace"))
                return
            time.sleep(0.2)
