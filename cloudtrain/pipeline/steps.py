"""``launch`` on a scheduler's allocation (provider: slurm): the job runs as one step of the
cluster's allocation (``srun``, one task per node), so the scheduler tracks every process,
accounts the GPUs and kills everything on ``scancel``. This first part runs a task's
``setup:`` then ``run:`` (or ``train:``: one torchrun a node, ranked by Slurm) on every node
with the cluster variables, streams each node's lines with its rank, and names the failing
node; ``-d``, ``--recover``, outputs and the job queue are not built here yet (refused,
saying so)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from cloudtrain.context import Env
from cloudtrain.errors import JobFailed, UserError
from cloudtrain.pipeline import run, stepfiles, torchrun
from cloudtrain.pipeline.provision import provision
from cloudtrain.pipeline.remote_job import new_job_id
from cloudtrain.pipeline.request import Launch
from cloudtrain.pipeline.teardown import down_shielded
from cloudtrain.provider.contract import BootstrapsSteps, RunsSteps

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.taskmodel import Task


def refuse_unbuilt(req: Launch) -> None:
    """What a step launch does not do yet: exit 2 before anything is created."""
    t = req.task
    what = ("launch -d" if req.detach else "launch --recover" if req.recover else "")
    if what:
        raise UserError(f"{what} is not built yet for provider '{t.resources.provider}'.",
                        "Run the job with run: (srun starts it once on every node of the "
                        "allocation); docs/slurm.md says what this part does.")


def cluster_env(handle: Handle, task: Task, job_id: str, overrides: dict[str, str]
                ) -> dict[str, str]:
    """The variables every node's task gets (its rank comes from Slurm: SLURM_NODEID)."""
    nodes = handle.nodes
    head = nodes[0]
    gpus = task.resources.gpus_per_job or (task.resources.accelerators.count
                                           if task.resources.accelerators else 0)
    out = {"CLOUDTRAIN_CLUSTER": handle.name, "CLOUDTRAIN_NUM_NODES": str(len(nodes)),
           "CLOUDTRAIN_NODE_IPS": "\n".join(n.internal_ip for n in nodes),
           "CLOUDTRAIN_HEAD_IP": head.internal_ip, "CLOUDTRAIN_GPUS_PER_NODE": str(gpus),
           "MASTER_ADDR": head.internal_ip, "MASTER_PORT": str(handle.row.master_port),
           "PYTHONUNBUFFERED": "1"}
    out.update(task.envs)
    out.update(overrides)
    out["CLOUDTRAIN_JOB_ID"] = job_id
    return out


# Each node's own values, from Slurm, for torchrun's line: its address (its line of
# CLOUDTRAIN_NODE_IPS, in Slurm's node order) and whether it hosts the c10d store.
_NODE_VARS = ('CT_NODE_IP=$(printf "%s\\n" "$CLOUDTRAIN_NODE_IPS" | sed -n "$((SLURM_NODEID + 1))p")\n'
              'CT_IS_HOST=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)\n')


def train_body(handle: Handle, task: Task, job_id: str) -> str:
    """``train:`` as one torchrun per node (pipeline/torchrun.py builds the line), its rank
    ``$SLURM_NODEID``."""
    assert task.train is not None
    gpus = task.resources.gpus_per_job or (task.resources.accelerators.count
                                           if task.resources.accelerators else 0)
    info = torchrun.NodeInfo(rank=0, num_nodes=len(handle.nodes), node_ip="@node@",
                             head_ip=handle.nodes[0].internal_ip,
                             master_port=handle.row.master_port, gpus=gpus)
    per_node = {"--node-rank=0": '--node-rank="$SLURM_NODEID"',
                "--local-addr=@node@": '--local-addr="$CT_NODE_IP"',
                "--rdzv-conf=is_host=1": '--rdzv-conf=is_host="$CT_IS_HOST"'}
    line = " ".join(per_node.get(a, shlex.quote(a))
                    for a in torchrun.command(task.train, info, job_id))
    return _NODE_VARS + line


def launch(env: Env, req: Launch) -> run.Outcome:
    """Up (the allocation), then the job as one step of it, recorded as a launch of the
    cluster; --down ends the allocation after, whatever happened."""
    refuse_unbuilt(req)
    task, name = req.task, req.name
    stepfiles.precheck(env, task, name)      # file_mounts' targets, before anything exists
    if env.state.get_cluster(name) is None:
        req.confirm(req.plan)
    try:
        handle, _ = provision(env, task, name, planned=req.plan)
        provider = handle.provider
        if not isinstance(provider, RunsSteps):
            raise UserError(f"provider '{provider.name}' cannot run job steps.", "")
        if isinstance(provider, BootstrapsSteps):     # once per allocation
            provider.bootstrap_steps(name, task.bootstrap.torch, task.bootstrap.torch_index,
                                     task.train is not None
                                     or "bootstrap" in task.model_fields_set, env.ui.info)
        job_id = new_job_id()
        stepfiles.before_step(env, handle, task, job_id, dict(req.overrides))   # file_mounts
        try:
            codes = _step(env, req, handle, provider, job_id)
        finally:
            stepfiles.after_step(env, handle, task, job_id)   # outputs, however it ended
    finally:
        if req.down_after:
            down_shielded(env, name, str(task.resources.provider))
    failed = sorted(r for r, c in codes.items() if c != 0)
    if failed:
        code = codes[failed[0]]
        raise JobFailed(code, failed[0],
                        f"Job {job_id} failed on node {failed[0]} (exit code {code}"
                        + (f"; also nodes {', '.join(map(str, failed[1:]))}" if failed[1:]
                           else "") + ").",
                        "Its lines above carry each node's rank.")
    return run.Outcome(job_id=job_id, exit_code=0, node_codes=dict(codes))


def _step(env: Env, req: Launch, handle: Handle, provider: RunsSteps, job_id: str
          ) -> dict[int, int]:
    """Run the job's step and record how it ended (each node's exit code, by rank)."""
    task = req.task
    body = "\n".join(x for x in (task.setup, task.run if task.train is None
                                   else train_body(handle, task, job_id)) if x)
    env.ui.step(f"Job {job_id}: one step of the allocation on {len(handle.nodes)} node(s)")
    plan = run.sync_plan(task)
    env.state.add_launch(req.name, job_id, task.name, False)
    env.state.set_job_envs(req.name, {**task.envs, **dict(req.overrides)})   # for exec
    try:
        codes = provider.run_step(req.name, job_id, plan.workdir, plan.workdir_filters(), body,
                                  cluster_env(handle, task, job_id, dict(req.overrides)),
                                  lambda rank, text: env.ui.node_line(rank, text)
                                  if rank >= 0 else env.ui.info(text),   # srun's own words
                                  task.resources.gpus_per_job)
    except BaseException:
        env.state.finish_launch(job_id, "CANCELLED", None, None)
        raise
    failed = sorted(r for r, c in codes.items() if c != 0)
    env.state.finish_launch(job_id, "FAILED" if failed else "SUCCEEDED",
                            codes[failed[0]] if failed else 0, failed[0] if failed else None)
    return codes
