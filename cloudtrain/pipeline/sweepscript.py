"""What one trial of a sweep runs (docs/sweep.md), composed on the laptop and handed to the
driver in the spec's ``script``: the task's ``run:`` as it is, or its ``train:`` as a
one-node torchrun on the trial's GPUs (``gpus_per_trial``). The driver runs it as a job of
the node's queue, with ``CLOUDTRAIN_PARAM_NAME`` in the environment and ``--name value`` in
``"$@"``; ``train:`` gets those arguments after its own (torchrun never sees them: they go
through ``CLOUDTRAIN_TRIAL_ARGS``, quoted by the shell)."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from cloudtrain.pipeline import sync, torchrun
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def train_line(task: Task, gpus: int) -> str:
    """``train:`` on one node with ``gpus`` processes, the trial's arguments appended."""
    train = task.train
    assert train is not None
    worker = ["python", "-u", train.script] if train.script else \
        ["python", "-u", "-m", str(train.module)]
    inner = "eval exec " + shlex.quote(torchrun.shell(worker + list(train.args))) + \
        " \"$CLOUDTRAIN_TRIAL_ARGS\""
    argv = ["python", "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={torchrun.nproc(train, gpus)}",
            f"--max-restarts={train.max_restarts}", "--monitor-interval=0.5",
            "--no-python", "bash", "-c", inner]
    return ("export CLOUDTRAIN_TRIAL_ARGS=\"$(printf '%q ' \"$@\")\"\n"
            "exec " + torchrun.shell(argv))


def trial_script(task: Task, head: NodeRow, gpus: int) -> str:
    """The trial's shell body: the task's envs, into the synced workdir (the node's Python
    first on PATH), then the task's command. Every node runs the same script, each in its
    own workdir: the driver starts the trials in the node's root (node/sweep.py), which
    holds it (``workdir``, as pipeline/sync.py puts it there)."""
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in task.envs.items()]
    if head.python_bin:
        lines.append(f"export PATH={shlex.quote(head.python_bin)}:\"$PATH\"")
    wd = shlex.quote(PurePosixPath(sync.workdir_on(head)).name)
    lines.append(f"mkdir -p {wd} && cd {wd} || exit 1")
    lines.append(str(task.run) if task.run is not None else train_line(task, gpus))
    return "\n".join(lines) + "\n"
