"""``cloudtrain exec`` on a scheduler's cluster (provider: slurm): the command runs as a step
of the allocation (the scheduler's ``srun --overlap``), never over SSH, with the variables a
job of the cluster gets and the last launch's task envs, each line with its node's rank; the
CLI exits with the first failing node's code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudtrain.context import Env
from cloudtrain.errors import JobFailed
from cloudtrain.pipeline.remote_job import new_job_id
from cloudtrain.provider.contract import ExecsSteps

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle


def scheduled(handle: Handle) -> bool:
    return isinstance(handle.provider, ExecsSteps)


def exec_env(env: Env, handle: Handle, job_id: str) -> dict[str, str]:
    """The cluster variables (the rank comes from the scheduler) and the last launch's envs."""
    nodes = handle.nodes
    head = nodes[0]
    out = {"CLOUDTRAIN_CLUSTER": handle.name, "CLOUDTRAIN_NUM_NODES": str(len(nodes)),
           "CLOUDTRAIN_NODE_IPS": "\n".join(n.internal_ip for n in nodes),
           "CLOUDTRAIN_HEAD_IP": head.internal_ip, "MASTER_ADDR": head.internal_ip,
           "MASTER_PORT": str(handle.row.master_port), "PYTHONUNBUFFERED": "1"}
    out.update(env.state.job_envs(handle.name))
    out["CLOUDTRAIN_JOB_ID"] = job_id
    return out


def run(env: Env, handle: Handle, command: str, ranks: list[int]) -> None:
    """The command on ``ranks`` as a step; JobFailed with the first failing node's code."""
    provider = handle.provider
    assert isinstance(provider, ExecsSteps)
    job_id = "exec-" + new_job_id()
    every = sorted(n.rank for n in handle.nodes)
    codes = provider.exec_step(handle.name, job_id, command, exec_env(env, handle, job_id),
                               lambda rank, text: env.ui.node_line(rank, text)
                               if rank >= 0 else env.ui.info(text),
                               None if sorted(ranks) == every else ranks)
    failed = sorted(r for r, c in codes.items() if c != 0)
    if failed:
        code = codes[failed[0]]
        raise JobFailed(code, failed[0], f"The command exited with code {code} on node "
                                         f"{failed[0]}.")
