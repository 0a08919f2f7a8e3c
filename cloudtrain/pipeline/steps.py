"""``launch`` on a scheduler's allocation (provider: slurm): the job runs as one step of the
cluster's allocation (``srun``, one task per node), so the scheduler tracks every process,
accounts the GPUs and kills everything on ``scancel``. A task's ``setup:`` then ``run:`` (or
``train:``: one torchrun a node, ranked by Slurm) runs on every node with the cluster
variables; each node's lines stream with its rank, and the failing node is named. The
launch's rules (--down's job end, the budget) and the task's idle stop go to the guard inside
the allocation first (pipeline/stepjobs.py), so they hold when this CLI is gone. With -d the
guard starts the step itself: the job survives this machine and the login session.
File mounts go in place before the step and outputs come back after it, however it ended
(pipeline/stepfiles.py). ``--recover`` is not built here yet (refused, saying so)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from cloudtrain.context import Env
from cloudtrain.errors import JobFailed, UserError
from cloudtrain.pipeline import rules, run, stepfiles, stepjobs, torchrun
from cloudtrain.pipeline.lastseen import saved
from cloudtrain.pipeline.provision import provision
from cloudtrain.pipeline.remote_job import new_job_id
from cloudtrain.pipeline.request import Launch
from cloudtrain.pipeline.teardown import down_shielded
from cloudtrain.pipeline.stepjobs import HasAllocationJobs
from cloudtrain.provider.contract import BootstrapsSteps, RunsSteps

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.taskmodel import Task


def refuse_unbuilt(req: Launch) -> None:
    """What a step launch does not do yet: exit 2 before anything is created."""
    t = req.task
    what = "launch --recover" if req.recover else ""
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
    """Up (the allocation), the launch's rules to its guard, then the job as one step of it,
    recorded as a launch of the cluster. --down ends the allocation after, whatever happened;
    with -d the guard does, once the job ended."""
    from cloudtrain.pipeline import guard as node_guard

    refuse_unbuilt(req)
    task, name = req.task, req.name
    stepfiles.precheck(env, task, name)      # file_mounts' targets, before anything exists
    node_guard.reconcile(env, name)     # an allocation its guard ended: closed, with why
    limit = rules.in_force(saved(env, name), req.budget, req.no_budget)
    if req.budget is not None and limit is not None:
        stepjobs.check_budget(env, name, req.plan, limit)
    if env.state.get_cluster(name) is None:
        req.confirm(req.plan)
    handed = False
    try:
        handle, _ = provision(env, task, name, planned=req.plan)
        provider = handle.provider
        if not isinstance(provider, RunsSteps) or not isinstance(provider, HasAllocationJobs):
            raise UserError(f"provider '{provider.name}' cannot run job steps.", "")
        if isinstance(provider, BootstrapsSteps):     # once per allocation
            provider.bootstrap_steps(name, task.bootstrap.torch, task.bootstrap.torch_index,
                                     task.train is not None
                                     or "bootstrap" in task.model_fields_set, env.ui.info)
        job_id = new_job_id()
        jobs = provider.allocation_jobs(name)
        stepjobs.launch_rules(env, handle, req, job_id, jobs)
        stepfiles.before_step(env, handle, task, job_id, dict(req.overrides))   # file_mounts
        if req.detach:      # its outputs stay in the workdir: 'cloudtrain outputs' pulls them
            handed = _detached(env, req, handle, jobs, job_id)
            return run.Outcome(job_id=job_id, exit_code=0, detached=True)
        try:
            codes = _step(env, req, handle, provider, job_id)
        finally:
            stepfiles.after_step(env, handle, task, job_id)   # outputs, however it ended
    finally:
        if req.down_after and not handed:
            down_shielded(env, name, str(task.resources.provider))
    failed = failed_first(codes)
    if failed:
        code, after = codes[failed[0]], failed[1:]
        raise JobFailed(code, failed[0],
                        f"Job {job_id} failed on node {failed[0]} (exit code {code}"
                        + (f"; node{'s' if after[1:] else ''} {', '.join(map(str, after))} "
                           "ended after it" if after else "") + ").",
                        "Its lines above carry each node's rank.")
    return run.Outcome(job_id=job_id, exit_code=0, node_codes=dict(codes))


def failed_first(codes: dict[int, int]) -> list[int]:
    """The failed ranks, the cause first: in the scheduler's order (``run_step``'s), the
    first that a stop signal did not end (a node the scheduler ended after another's bad
    exit says 143 or 137), else the first."""
    failed = [r for r, c in codes.items() if c != 0]
    cause = next((r for r in failed if codes[r] not in (128 + 9, 128 + 15)), None)
    return failed if cause is None else [cause] + [r for r in failed if r != cause]


def _body(handle: Handle, task: Task, job_id: str) -> str:
    return "\n".join(x for x in (task.setup, task.run if task.train is None
                                 else train_body(handle, task, job_id)) if x)


def _detached(env: Env, req: Launch, handle: Handle, jobs: stepjobs.AllocationJobs,
              job_id: str) -> bool:
    """Hand the job to the allocation's guard, which srun's it (Slurm holds the step until it
    fits). With --down, the guard ends the allocation once the job ended (the rules were
    written first). True once the job is handed over."""
    task = req.task
    plan = run.sync_plan(task)
    env.ui.step(f"Job {job_id}: handed to the allocation's guard (one step on "
                f"{len(handle.nodes)} node(s))")
    took = jobs.submit(job_id, plan.workdir, plan.workdir_filters(),
                       _body(handle, task, job_id),
                       cluster_env(handle, task, job_id, dict(req.overrides)),
                       task.resources.gpus_per_job)
    env.state.add_launch(req.name, job_id, task.name, True)
    env.state.set_job_envs(req.name, {**task.envs, **dict(req.overrides)})   # for exec
    if not took:
        env.ui.warn(f"the allocation's guard has not taken job {job_id} within 20 s; it "
                    f"starts it once it runs (cloudtrain logs {req.name} --guard shows what "
                    "it did)")
    return True


def _step(env: Env, req: Launch, handle: Handle, provider: RunsSteps, job_id: str
          ) -> dict[int, int]:
    """Run the job's step and record how it ended (each node's exit code, by rank); its
    lines are kept here too (``logs``)."""
    task = req.task
    body = _body(handle, task, job_id)
    env.ui.step(f"Job {job_id}: one step of the allocation on {len(handle.nodes)} node(s)")
    plan = run.sync_plan(task)
    env.state.add_launch(req.name, job_id, task.name, False)
    env.state.set_job_envs(req.name, {**task.envs, **dict(req.overrides)})   # for exec
    keep = stepjobs.LineKeeper(env.logs_dir(req.name) / job_id)

    def line(rank: int, text: str) -> None:
        if rank < 0:
            env.ui.info(text)          # srun's own words
            return
        env.ui.node_line(rank, text)
        keep.add(rank, text)
    try:
        codes = provider.run_step(req.name, job_id, plan.workdir, plan.workdir_filters(), body,
                                  cluster_env(handle, task, job_id, dict(req.overrides)),
                                  line, task.resources.gpus_per_job)
    except BaseException:
        env.state.finish_launch(job_id, "CANCELLED", None, None)
        raise
    finally:
        keep.close()
    failed = failed_first(codes)
    env.state.finish_launch(job_id, "FAILED" if failed else "SUCCEEDED",
                            codes[failed[0]] if failed else 0, failed[0] if failed else None)
    return codes
