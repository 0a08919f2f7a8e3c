"""A job's outputs back on this machine, and nothing of them lost at ``down``.

Every job whose task declares ``outputs:`` is recorded when it starts (the paths, head or
every node, the local folder: ``state.OutputsRow``). An attached launch pulls them when the
job ends; ``cloudtrain outputs NAME [--job ID]`` (:mod:`cloudtrain.pipeline.pullnow`) pulls
them at any time, with the same safe staging (``sync.pull``). Once pulled after the job
ended, they are marked pulled. ``down`` pulls first what was never pulled
(:func:`before_down`), or refuses (exit 2) when it cannot, unless told to discard them; a
teardown that goes ahead without them (``--discard-outputs``, a cluster that stopped itself)
records why, so the ledger and ``status`` can say so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cloudtrain.cluster import Handle, connect, get_handle
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, RemoteError, UserError
from cloudtrain.pipeline import sync
from cloudtrain.schema import OutputsRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task

Unpulled = Literal["pull", "try", "discard"]
"""What ``down`` does with outputs never pulled: pull them or refuse (the ``down`` command);
pull them when it can, else go ahead and say so (launch --down); go ahead without them."""


def record(env: Env, name: str, job_id: str, task: Task) -> None:
    """The job's outputs, as its task declares them, when it starts."""
    if task.outputs:
        env.state.add_outputs(OutputsRow(job_id, name, list(task.outputs),
                                         task.outputs_from == "all", str(task.outputs_path()),
                                         time.time()))


def pull_row(env: Env, handle: Handle, row: OutputsRow) -> tuple[list[Path], bool]:
    """Pull ``row``'s outputs from the nodes into its folder. Returns what came back and
    whether every node answered (a path the node does not have is not a failure)."""
    from cloudtrain.pipeline import sharedfs
    if isinstance(handle.provider, sharedfs.SharesFiles):    # a scheduler's shared filesystem
        return sharedfs.pull_row(env, handle, row)
    dest_root = Path(row.dest)
    got: list[Path] = []
    ok = True
    nodes = handle.nodes if row.from_all else handle.nodes[:1]
    for n in nodes:
        dest = dest_root / f"node-{n.rank}" if row.from_all else dest_root
        for rel in row.paths:
            try:
                pulled = sync.pull(n, handle.keys, rel, dest)
                for what in pulled.skipped:
                    env.ui.warn(f"output '{rel}' on node {n.rank}: not copied: {what}")
                if pulled.found:
                    got.append(dest / rel.rstrip("/"))
                elif not pulled.skipped:
                    env.ui.warn(f"output '{rel}' does not exist on node {n.rank}")
            except RemoteError as exc:
                ok = False
                env.ui.warn(str(exc))
    if got:
        env.ui.ok("Outputs: " + ", ".join(str(p) for p in got))
    return got, ok


def pull_ended(env: Env, handle: Handle, job_id: str, task: Task) -> list[Path]:
    """An attached launch's pull, once its job has ended (or was stopped)."""
    row = next((r for r in env.state.outputs(handle.name) if r.job_id == job_id), None)
    if row is None:   # not recorded (the job never started): the task says what
        row = OutputsRow(job_id, handle.name, list(task.outputs), task.outputs_from == "all",
                         str(task.outputs_path()), time.time())
    got, ok = pull_row(env, handle, row)
    if ok:
        settle(env, row)
    return got


def settle(env: Env, row: OutputsRow) -> None:
    """``row``'s job has ended and its outputs were pulled: they are marked pulled, and so
    are those of the earlier jobs that declared the same outputs (the same paths on the node,
    pulled into the same folder just now: a job recovery replaced, an earlier run)."""
    def same(r: OutputsRow) -> bool:
        return (r.dest, r.from_all, r.paths) == (row.dest, row.from_all, row.paths)

    env.state.mark_outputs([row.job_id] + [
        r.job_id for r in env.state.outputs(row.cluster)
        if r.pulled_at is None and r.started_at <= row.started_at and same(r)], pulled=True)


def unpulled(env: Env, name: str) -> list[OutputsRow]:
    """The cluster's jobs whose outputs were neither pulled after they ended nor given up."""
    return [r for r in env.state.outputs(name) if r.pulled_at is None and r.lost is None]


def before_down(env: Env, name: str, how: Unpulled) -> None:
    """Before ``down`` removes the nodes: pull the outputs never pulled (each distinct
    declaration once, the latest job's), or refuse (exit 2, nothing torn down), or go ahead
    without them saying so (``how``)."""
    rows = unpulled(env, name)
    if not rows:
        return
    jobs = ", ".join(r.job_id for r in rows)
    if how == "discard":
        gone(env, rows, "discarded: down --discard-outputs")
        return
    env.ui.warn(f"'{name}': the outputs of job {jobs} were never pulled: pulling them before "
                "the teardown")
    try:
        _pull_all(env, name, rows)
    except CloudtrainError as exc:
        if how == "try":
            gone(env, rows, f"not pulled: {exc.message}")
            return
        raise UserError(
            f"'{name}': the outputs of job {jobs} were never pulled, and pulling them failed: "
            f"{exc.message} Nothing was torn down.",
            f"Run 'cloudtrain down {name}' again once its nodes answer, or tear it down "
            f"without them: cloudtrain down {name} --discard-outputs") from None
    env.state.mark_outputs([r.job_id for r in rows], pulled=True)


def _pull_all(env: Env, name: str, rows: list[OutputsRow]) -> None:
    handle = get_handle(env, name)
    from cloudtrain.pipeline.sharedfs import SharesFiles
    if not isinstance(handle.provider, SharesFiles):     # (those are read through a login node)
        if not handle.nodes:
            raise RemoteError(f"'{name}' has no node running.", "")
        connect(env, handle, timeout=15).close()   # every node answers, or this raises
    done: set[tuple[str, bool, tuple[str, ...]]] = set()
    for row in reversed(rows):
        key = (row.dest, row.from_all, tuple(row.paths))
        if key in done:
            continue
        done.add(key)
        if not pull_row(env, handle, row)[1]:
            raise RemoteError(f"a node did not answer while pulling job {row.job_id}'s "
                              "outputs.", "")


def gone(env: Env, rows: list[OutputsRow], why: str) -> str:
    """Record that ``rows``' outputs go with the nodes (``why``), say so, and return the
    words for the ledger and ``status``: "outputs of job X were not pulled"."""
    if not rows:
        return ""
    env.state.mark_outputs([r.job_id for r in rows], lost=why)
    words = f"outputs of job {', '.join(r.job_id for r in rows)} were not pulled"
    env.ui.warn(f"{words} ({why})")
    return words
