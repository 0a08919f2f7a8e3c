"""The preflight from start to verdict (run on the nodes, judge), for ``cloudtrain
preflight`` and for the launch it guards: ``launch --preflight``, and by itself before the
first multi-node launch on a cluster (``--no-preflight`` turns that off). A failing preflight
stops the launch before its job starts; the cluster stays up; the launch's ledger row keeps
the verdict (status shows it)."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.preflight import runner, show
from cloudtrain.preflight.runner import Options, PreflightFailed
from cloudtrain.preflight.verdict import Context, judge
from cloudtrain.remote import Group

if TYPE_CHECKING:
    from cloudtrain.pipeline.request import Launch

AUTO_VAR = "CLOUDTRAIN_AUTO_PREFLIGHT"
"""0 (or off/no/false): no automatic preflight before a first multi-node launch."""

__all__ = ["PreflightFailed", "before_job", "check", "record"]


def check(env: Env, handle: Handle, group: Group, opts: Options,
          threshold: float = 0.7) -> show.Result:
    """Run the node program on every node and judge its figures."""
    ran = runner.run(env, handle, group, opts)
    ctx = Context(handle.name, handle.row.provider, handle.row.instance_type, threshold,
                  {n.rank: n.internal_ip for n in handle.nodes})
    return show.Result(ran.job_id, ran.measured, judge(ran.measured, ctx), ctx, ran.took_s)


def on_cluster(env: Env, name: str, opts: Options, threshold: float) -> show.Result:
    """``cloudtrain preflight NAME``: connect, refuse a busy cluster (exit 2: a preflight
    beside a running job would measure both the wrong way), check."""
    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.errors import UserError
    from cloudtrain.pipeline import queue

    handle = get_handle(env, name)
    group = connect(env, handle, timeout=30)
    try:
        busy = queue.active(queue.records(handle, group))
        if busy:
            raise UserError(f"Cluster '{name}' is busy: job {busy[0]['id']} is "
                            f"{busy[0].get('state')}; a preflight beside it would measure "
                            "both the wrong way.",
                            f"Wait for it to end, or stop it: cloudtrain cancel {name} "
                            f"{busy[0]['id']}")
        return check(env, handle, group, opts, threshold)
    finally:
        group.close()


def why_run(env: Env, handle: Handle, req: Launch) -> str | None:
    """Why this launch runs a preflight first, None when it does not: asked (--preflight),
    or the first multi-node launch on this cluster (unless --no-preflight)."""
    if req.preflight is False:
        return None
    if req.preflight:
        return "--preflight"
    if os.environ.get(AUTO_VAR, "1").strip().lower() in ("0", "off", "no", "false"):
        return None     # the automatic run turned off for every launch (CI, the test suite)
    if len(handle.nodes) < 2 or req.task.container is not None:
        return None     # one node: nothing to prove between nodes; a container: the image's torch
    if any(not n.python_bin or n.bootstrap.get("torch", "missing") in ("", "missing")
           for n in handle.nodes):
        return None     # not bootstrapped, or no PyTorch: a run: task may not need any
    born = handle.row.created_at or 0.0    # a cluster of the same name before: not this one
    earlier = [r for r in env.state.launches(handle.name)
               if not r.job_id.startswith("exec-") and r.started_at >= born]
    return None if earlier else "the first multi-node launch on this cluster"


def before_job(env: Env, handle: Handle, group: Group, req: Launch,
               job_id: str) -> show.Result | None:
    """The preflight a launch asks for, before its job; raises PreflightFailed (its ledger
    row written, marked PREFLIGHT_FAILED) when it fails."""
    why = why_run(env, handle, req)
    if why is None:
        return None
    env.ui.step(f"Preflight ({why}; --no-preflight skips it)")
    try:
        result = check(env, handle, group, Options())
    except PreflightFailed as exc:
        _refused(env, handle, req, job_id, exc.message, None)
        raise PreflightFailed(exc.message, _next_steps(handle.name)) from exc
    if result.verdict.ok:
        env.ui.ok(result.verdict.paragraph)
        return result
    _refused(env, handle, req, job_id, result.verdict.paragraph, result)
    raise PreflightFailed(result.verdict.paragraph + " The job was not started; the cluster "
                          "is still up.", _next_steps(handle.name))


def not_under_recovery(env: Env, req: Launch) -> show.Result | None:
    """The recovery controller's attempts run none (a replacement's nodes are new, and its
    job must resume at once): --preflight says so instead of being ignored."""
    if req.preflight:
        env.ui.warn("--preflight does not run under --recover: run 'cloudtrain preflight "
                    f"{req.name}' before the launch instead.")
    return None


def _next_steps(name: str) -> str:
    return (f"Look closer with 'cloudtrain preflight {name}'; launch anyway with "
            f"--no-preflight; or replace the nodes: 'cloudtrain down {name}' and launch (or "
            "'up') again.")


def _refused(env: Env, handle: Handle, req: Launch, job_id: str, why: str,
             result: show.Result | None) -> None:
    """The launch's ledger row for a launch its preflight stopped."""
    env.state.add_launch(handle.name, job_id, req.task.name, req.detach, req.task.container)
    named = [p.node for p in result.verdict.problems if p.node is not None] if result else []
    env.state.finish_launch(job_id, "PREFLIGHT_FAILED", runner.EXIT_FAILED,
                            named[0] if named else None, why)
    env.state.set_launch_preflight(job_id, show.record(result) if result is not None else
                                   json.dumps({"ok": False, "at": time.time(), "paragraph": why}))


def record(env: Env, job_id: str, result: show.Result | None) -> None:
    """The passing preflight into the row of the launch it guarded (once the row exists)."""
    if result is not None:
        env.state.set_launch_preflight(job_id, show.record(result))
