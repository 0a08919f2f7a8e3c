"""``cloudtrain queue`` and ``cancel``: the jobs of a cluster's queue (docs/queue.md).

Only click is imported at module level; each command imports what it needs when it runs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import click

from cloudtrain.commands.base import CONTEXT, check_name, guard, open_env

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.remote import Group

JOB_ID = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")


@click.command(name="queue", context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (a JSON list).")
@guard
def queue_(cluster_name: str, as_json: bool) -> None:
    """List the jobs of the cluster's queue, oldest first: state (queued, running,
    succeeded, failed, cancelled), the GPU slots a running job holds (what a queued one
    waits for), submitted and started time, duration, exit code and who submitted them.
    The queue lives on the nodes: jobs queued with 'launch -d' start there when their
    turn comes, with no CLI connected.

    \b
    Example:
      cloudtrain queue mycluster
      cloudtrain queue mycluster --json"""
    import json

    env = open_env(quiet=True)
    recs = _node_rows(env, cluster_name, as_json)
    if recs is None:          # Slurm: shown from its steps (pipeline/stepjobs.py)
        return
    if as_json:
        click.echo(json.dumps(recs, indent=2))
        return
    if not recs:
        click.echo(f"No jobs in the queue of '{cluster_name}'.")
        return
    head = ("JOB", "STATE", "GPUS", "SUBMITTED", "STARTED", "DURATION", "EXIT", "SUBMITTER",
            "TASK")
    from cloudtrain.units import duration

    table = [head] + [tuple(_cell(r[k]) if k != "duration_s" else
                            ("-" if r[k] is None else duration(r[k]))
                            for k in ("id", "state", "gpus_cell", "submitted", "started",
                                      "duration_s", "exit_code", "submitter", "task"))
                      for r in recs]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    for r in recs:
        if r["reason"]:
            click.echo(f"{r['id']}: {r['state']}: {r['reason']}")


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.argument("job_id", required=False)
@click.option("--all", "all_jobs", is_flag=True, help="Every queued and running job.")
@guard
def cancel(cluster_name: str, job_id: str | None, all_jobs: bool) -> None:
    """Cancel a job of the cluster's queue: a queued one is removed (it never runs), a
    running one is stopped on every node (SIGTERM, then SIGKILL after the task's
    stop_grace) and the next queued job starts.

    \b
    Example:
      cloudtrain cancel mycluster 20261124-101500-ab12cd
      cloudtrain cancel mycluster --all"""
    from cloudtrain.errors import UserError
    from cloudtrain.pipeline import queue

    if (job_id is None) == (not all_jobs):
        raise UserError("cancel takes one JOB_ID or --all, not both and not neither.",
                        f"List the jobs: cloudtrain queue {cluster_name}")
    if job_id is not None and not JOB_ID.match(job_id):
        raise UserError(f"JOB_ID '{job_id}' is not a job id (like 20261124-101500-ab12cd).",
                        f"List the jobs: cloudtrain queue {cluster_name}")
    env = open_env()
    from cloudtrain.pipeline import stepjobs
    if stepjobs.scheduled(env, cluster_name):    # Slurm: scancel of the job's step
        return stepjobs.cancel(env, cluster_name, job_id)
    handle, group = _connected(env, cluster_name)
    try:
        queue.cancel_jobs(env, handle, group, job_id)
    finally:
        group.close()


def _node_rows(env: Env, name: str, as_json: bool) -> list[dict[str, Any]] | None:
    """The queue's records from the nodes; None when the cluster is a Slurm allocation,
    whose jobs were shown from its steps (through the login node)."""
    from cloudtrain.pipeline import stepjobs

    if stepjobs.scheduled(env, name):
        stepjobs.show_queue(env, name, as_json)
        return None
    handle, group = _connected(env, name)
    try:
        return rows(_records(handle, group))
    finally:
        group.close()


def _connected(env: Env, name: str) -> tuple[Handle, Group]:
    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.pipeline import guard as node_guard

    check_name(name)
    handle = get_handle(env, name)
    group = connect(env, handle, timeout=30)
    node_guard.touch(env, handle, group)
    return handle, group


def _records(handle: Handle, group: Group) -> list[dict[str, Any]]:
    from cloudtrain.pipeline import queue

    return queue.records(handle, group)


def rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as ``queue`` shows them: times in local time, duration in seconds."""
    import time

    def when(t: Any) -> str | None:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else None

    out = []
    for r in recs:
        start, end = r.get("started_at"), r.get("ended_at")
        dur = (end or time.time()) - start if start else None
        out.append({"id": r["id"], "state": r.get("state"), "task": r.get("task"),
                    "submitter": r.get("submitter"), "submitted": when(r.get("submitted_at")),
                    "started": when(start), "ended": when(end),
                    "duration_s": None if dur is None else round(dur, 1),
                    "exit_code": r.get("exit_code"), "reason": r.get("reason"),
                    "waiter_restarts": r.get("waiter_restarts") or 0,
                    "gpus": r.get("gpus"), "held": r.get("held") or [],
                    "gpus_cell": gpus_cell(r)})
    return out


def gpus_cell(r: dict[str, Any]) -> str:
    """The GPUS column: the slots a running job holds ("0,1"; "all" for a record from before
    slots), what a queued one waits for ("wants 2", "wants all"), "-" once it has ended."""
    held = r.get("held")
    if r.get("state") == "running":
        return ",".join(str(i) for i in held) if isinstance(held, list) and held else "all"
    if r.get("state") == "queued":
        return f"wants {r['gpus']}" if isinstance(r.get("gpus"), int) else "wants all"
    return "-"


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    for command in (queue_, cancel):
        cli.add_command(command)
