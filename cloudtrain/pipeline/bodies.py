"""The job's body on a node (run.py's scripts end with it): torchrun for ``train:``, the
task's ``run:``, each inside the node's container when the task has ``container:``
(:mod:`cloudtrain.containers.wrap`), with the checkpoint restore and upload around it on the
host (:func:`cloudtrain.pipeline.storage.wrap_body`)."""

from __future__ import annotations

import posixpath
import shlex
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Iterable

from cloudtrain.cluster import Handle
from cloudtrain.containers import wrap
from cloudtrain.pipeline import bootstrap, storage, sync, torchrun
from cloudtrain.pipeline.remote_job import job_dir
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def train_body(handle: Handle, node: NodeRow, task: Task, job_id: str, box: str | None = None,
               names: Iterable[str] = ()) -> str:   # box: the node's container (wrap.py)
    assert task.train is not None
    head = handle.nodes[0]
    gpus = min([(n.gpus or 0) for n in handle.nodes] + [task.resources.gpus_per_job or 64])
    info = torchrun.NodeInfo(rank=node.rank, num_nodes=len(handle.nodes), node_ip=node.internal_ip,
                             head_ip=head.internal_ip, master_port=handle.row.master_port, gpus=gpus)
    wrapper = str(PurePosixPath(bootstrap.script_dir(node)) / "ctworker.sh")
    if not wrapper.startswith("/"):   # a root under the login's $HOME: the job runs in the workdir
        wrapper = posixpath.relpath(wrapper, sync.workdir_on(node))
    ranks = str(PurePosixPath(job_dir(node, job_id)) / "ranks")
    cmd = torchrun.shell(torchrun.command(task.train, info, job_id, wrapper, log_dir=ranks))
    prefix = f"export {torchrun.PREFIX_VAR}={shlex.quote(torchrun.PREFIX_TEMPLATE)}\n"
    cmd = "{\n" + wrap.inside(node, box, [*names, torchrun.PREFIX_VAR], cmd) + "\n}" \
        if box is not None else cmd if task.checkpoints else "exec " + cmd
    # With checkpoints the job is not exec'd: the restore comes first, the watch beside it.
    return prefix + (storage.wrap_body(task, node, cmd) if task.checkpoints else cmd)


def run_body(task: Task, node: NodeRow, box: str | None = None, names: Iterable[str] = ()) -> str:
    body = wrap.maybe(node, box, names, str(task.run))
    return storage.wrap_body(task, node, "{\n" + body + "\n}") if task.checkpoints else body
