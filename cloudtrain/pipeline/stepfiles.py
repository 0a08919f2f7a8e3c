"""A scheduler's cluster (provider: slurm): ``file_mounts`` and ``outputs:`` on its shared
filesystem, moved through the login node (never over SSH to a compute node).

Before a job's step, its local ``file_mounts`` are rsynced to their targets and its bucket
mounts fetched there by rclone on the login node (the provider does both: ``put_mounts``);
its outputs are recorded (:func:`cloudtrain.pipeline.outputs.record`). After the step, however
it ended (a failure, Ctrl-C), its outputs are pulled from the workdir on the shared
filesystem with the same staging and checks as every provider's (``sync.pull``: nothing lands
outside the outputs folder, links and special files are not copied). Every node writes into
the same workdir, so the outputs come once, straight into the outputs folder, also with
``outputs_from: all``. Nothing on the shared filesystem is ever deleted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, RemoteError
from cloudtrain.pipeline import outputs
from cloudtrain.pipeline.sharedfs import SharesFiles, pull_row
from cloudtrain.schema import OutputsRow

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.taskmodel import Task


def _store_program(envs: Mapping[str, str]) -> str:
    """The job's environment (one line of JSON), then cloudtrain's storage agent
    (cloudtrain/node/store.py): what the login node's python3 reads on stdin."""
    agent = (Path(__file__).resolve().parent.parent / "node" / "store.py").read_text()
    return json.dumps(dict(envs)) + "\n" + agent


def precheck(env: Env, task: Task, name: str) -> None:
    """Before anything is created: the file_mounts targets can be written on the shared
    filesystem, and the login node has rclone for bucket mounts (else exit 2)."""
    from cloudtrain.pipeline.plan import cluster_request

    if not task.file_mounts:
        return
    provider = env.provider(str(task.resources.provider))
    if isinstance(provider, SharesFiles):
        provider.check_files(cluster_request(task, name, public_key=""),
                             list(task.local_mounts()), bool(task.bucket_mounts()))


def before_step(env: Env, handle: Handle, task: Task, job_id: str,
                overrides: Mapping[str, str]) -> None:
    """The job's file_mounts on the shared filesystem, and its outputs recorded."""
    local = {t: (task.base_dir / s).resolve() for t, s in task.local_mounts().items()}
    buckets = {t: str(u) for t, u in task.bucket_mounts().items()}
    provider = handle.provider
    if (local or buckets) and isinstance(provider, SharesFiles):
        env.ui.step(f"file_mounts: {len(local)} local, {len(buckets)} bucket(s), through the "
                    "login node")
        provider.put_mounts(handle.name, local, buckets,
                            _store_program({**task.envs, **overrides}) if buckets else "",
                            env.ui.info)
    outputs.record(env, handle.name, job_id, task)


def after_step(env: Env, handle: Handle, task: Task, job_id: str) -> None:
    """Pull the job's outputs once its step has ended, however it ended; a pull that fails
    is said (``cloudtrain outputs`` and ``down`` pull them again)."""
    if not task.outputs:
        return
    try:
        outputs.pull_ended(env, handle, job_id, task)
    except CloudtrainError as exc:
        env.ui.warn(f"job {job_id}'s outputs were not pulled: {exc.message} (run 'cloudtrain "
                    f"outputs {handle.name}' to pull them; 'down' pulls them too)")


def pull_now(env: Env, handle: Handle, row: OutputsRow) -> tuple[OutputsRow, list[Path], bool]:
    """``cloudtrain outputs`` on a scheduler's cluster: pull now; the job has ended when its
    launch is recorded as ended (only then are its outputs marked pulled)."""
    launch = next((x for x in env.state.launches(handle.name) if x.job_id == row.job_id), None)
    ended = launch is None or launch.status != "RUNNING"
    got, ok = pull_row(env, handle, row)
    if not ok:
        raise RemoteError(f"the outputs of job {row.job_id} could not all be pulled from "
                          f"'{handle.name}' (above).",
                          f"Check the login node, then run 'cloudtrain outputs {handle.name}' "
                          "again.")
    if ended:
        outputs.settle(env, row)
    return row, got, ended
