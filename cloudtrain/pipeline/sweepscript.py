"""What one trial of a sweep runs (docs/sweep.md), composed on the laptop and handed to the
driver in the spec's ``script``: the task's ``run:`` as it is, or its ``train:`` as a
one-node torchrun on the trial's GPUs (``gpus_per_trial``). The driver runs it as a job of
the node's queue, with ``CLOUDTRAIN_PARAM_NAME`` in the environment and ``--name value`` in
``"$@"``; ``train:`` gets those arguments after its own (torchrun never sees them: they go
through ``CLOUDTRAIN_TRIAL_ARGS``, quoted by the shell)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from cloudtrain.pipeline import torchrun
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
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


def own_workdir(task: Task) -> list[str]:
    """The trial's own copy of the node's synced workdir, made in its folder and entered:
    the code copied (``rsync -a``, no hard links: a trial that appends to a file in place
    changes only its copy), less the task's ``outputs:`` (each trial writes its own), and the
    file mounts inside the workdir linked rather than copied (data: read, not written)."""
    from cloudtrain.pipeline.run import sync_plan

    outs = [o.strip("/") for o in task.outputs if o.strip("/") not in ("", ".")]
    shared = [m.strip("/") for m in sync_plan(task).protect if m not in task.outputs]
    shared = [m for m in shared if m and m != "."]
    excl = " ".join(shlex.quote(f"--exclude=/{p}") for p in outs + shared)
    lines = ['src="$CLOUDTRAIN_SYNCED_WORKDIR"; w="$CLOUDTRAIN_TRIAL_DIR/work"',
             'mkdir -p "$w" || exit 1',
             f'if [ -d "$src" ]; then rsync -a {excl} "$src/" "$w/" || exit 1; fi'.replace("  ", " ")]
    for m in shared:
        q = shlex.quote(m)
        lines.append(f'if [ -e "$src"/{q} ]; then mkdir -p "$(dirname "$w"/{q})" && '
                     f'ln -sfn "$src"/{q} "$w"/{q} || exit 1; fi')
    lines.append('cd "$w" || exit 1')
    return lines


def trial_script(task: Task, head: NodeRow, gpus: int) -> str:
    """The trial's shell body: the task's envs, the node's Python first on PATH, into the
    trial's own copy of the node's synced workdir (:func:`own_workdir`), then the task's
    command. Every node runs the same script: the driver starts the trials in the node's
    root (node/sweep.py), and the copy is made from that node's own workdir."""
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in task.envs.items()]
    if head.python_bin:
        lines.append(f"export PATH={shlex.quote(head.python_bin)}:\"$PATH\"")
    lines += own_workdir(task)
    lines.append(str(task.run) if task.run is not None else train_line(task, gpus))
    return "\n".join(lines) + "\n"


def prepare_nodes(env: Env, handle: Handle, task: Task, name: str) -> None:
    """Before the sweep's driver starts: the launch chain's sync and ``setup:`` on every node
    (pipeline/run.py ``prepare``: once per content hash, as a launch runs it), so every
    trial finds the node set up. Its logs are the sweep job's (``sweep-NAME``)."""
    from cloudtrain.cluster import connect
    from cloudtrain.pipeline.run import prepare

    group = connect(env, handle)
    try:
        prepare(env, handle, group, task, f"sweep-{name}")
    finally:
        group.close()
