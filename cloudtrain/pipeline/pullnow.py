"""``cloudtrain outputs NAME [--job ID]``: pull a job's outputs now, whether it runs or has
ended, with the same safe staging as an attached launch (:mod:`cloudtrain.pipeline.outputs`).
A job that has ended (its exit code is on the nodes) has its outputs marked pulled; a running
one's are pulled as they are so far, and ``down`` pulls them again."""

from __future__ import annotations

import shlex
from pathlib import Path

from cloudtrain.cluster import Handle, connect, get_handle
from cloudtrain.context import Env
from cloudtrain.errors import RemoteError, UserError
from cloudtrain.pipeline.outputs import pull_row, settle
from cloudtrain.pipeline.remote_job import job_dir
from cloudtrain.remote import Group, bash
from cloudtrain.schema import NodeRow, OutputsRow


def _pick(env: Env, name: str, job_id: str | None) -> OutputsRow:
    rows = env.state.outputs(name)
    if job_id is None:
        if not rows:
            raise UserError(f"No job on '{name}' declared outputs: there is nothing to pull.",
                            "List the paths to bring back under 'outputs:' in the task file "
                            "(e.g. outputs: [checkpoints/]) and launch it.")
        return rows[-1]
    row = next((r for r in rows if r.job_id == job_id), None)
    if row is None:
        known = ", ".join(r.job_id for r in rows) or "none"
        raise UserError(f"--job {job_id}: no job of '{name}' with that id declared outputs "
                        f"(jobs with outputs: {known}).",
                        "Give one of those ids, or leave --job out for the latest.")
    return row


def _ended(group: Group, handle: Handle, row: OutputsRow) -> bool:
    """Whether the job has ended on the nodes its outputs come from: its exit code is there,
    or its folder is gone (pruned with the old jobs')."""
    ranks = [n.rank for n in (handle.nodes if row.from_all else handle.nodes[:1])]

    def cmd(n: NodeRow) -> str:
        jdir = shlex.quote(job_dir(n, row.job_id))
        return bash(f"if [ -f {jdir}/rc ] || [ ! -d {jdir} ]; then echo ended; fi")

    res = group.run(cmd, ranks=ranks, timeout=30)
    return all(r.ok and "ended" in r.stdout for r in res.values())


def pull_job(env: Env, name: str, job_id: str | None) -> tuple[OutputsRow, list[Path], bool]:
    """``cloudtrain outputs``: pull a job's outputs now (the latest job that declared some, by
    default). Returns the job, what came back, and whether the job had ended (only then are
    its outputs marked pulled: a running job writes more)."""
    from cloudtrain.names import check

    check(name)
    handle = get_handle(env, name)
    row = _pick(env, name, job_id)
    if row.job_id.startswith("sweep-") and env.state.get_sweep(row.job_id[6:]) is not None:
        from cloudtrain.pipeline import sweepout   # a sweep's: every ended trial's, in its folder

        done = sweepout.pull_now(env, name, row.job_id[6:])
        now = sweepout.row_of(env, name, row.job_id[6:])     # pulled: finished, all here
        return row, [done.folder] if done else [], bool(now and now.pulled_at is not None)
    from cloudtrain.pipeline import sharedfs, stepfiles
    if isinstance(handle.provider, sharedfs.SharesFiles):    # through the login node
        return stepfiles.pull_now(env, handle, row)
    group = connect(env, handle, timeout=15)
    try:
        ended = _ended(group, handle, row)
    finally:
        group.close()
    got, ok = pull_row(env, handle, row)
    if not ok:
        raise RemoteError(f"the outputs of job {row.job_id} could not all be pulled from "
                          f"'{name}' (above).", "Check the nodes with 'cloudtrain status "
                          f"{name} --refresh' and run 'cloudtrain outputs {name}' again.")
    if ended:
        settle(env, row)
    return row, got, ended
