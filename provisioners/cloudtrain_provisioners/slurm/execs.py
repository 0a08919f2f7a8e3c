"""``cloudtrain exec`` on a Slurm cluster: the command as one more step of the allocation,
``srun --jobid=<allocation> --overlap`` (it runs beside a job already running there, on the
same nodes, instead of waiting for its GPUs), on every node or on one (``-w <node>``), in the
workdir with the cluster variables. Lines come back labelled with the node's rank; each node's
exit code from srun's report, as for a job (steps.py)."""

from __future__ import annotations

from typing import Callable, Mapping

from cloudtrain.errors import UserError

from cloudtrain_provisioners.slurm import sched, steps
from cloudtrain_provisioners.slurm.login import Login


def run(login: Login, alloc: sched.Allocation, job_id: str, workdir: str, script: str,
        line: Callable[[int, str], None], ranks: list[int] | None) -> dict[int, int]:
    """Each asked node's exit code by rank (``ranks`` None: every node of the allocation)."""
    every = list(range(alloc.node_count))
    if ranks is None or sorted(ranks) == every:
        return steps.run(login, alloc.job_id, alloc.node_count, job_id, workdir, script, line,
                         ["--overlap", "--kill-on-bad-exit=0"])
    names = sched.hostnames(login, alloc.nodelist)
    out: dict[int, int] = {}
    for rank in ranks:          # exec --node: one node, one step (labelled 0 by srun)
        if not 0 <= rank < len(names):
            raise UserError(f"the allocation has no node {rank}.",
                            f"Its nodes are 0..{len(names) - 1}.")
        codes = steps.run(login, alloc.job_id, 1, job_id, workdir, script, _as(rank, line),
                          ["--overlap", "-w", names[rank]])
        out[rank] = codes[0]
    return out


def _as(rank: int, line: Callable[[int, str], None]) -> Callable[[int, str], None]:
    """A one-node step's lines (srun labels its only task 0) under the node's own rank."""
    def out(r: int, text: str) -> None:
        line(rank if r >= 0 else r, text)
    return out


def script(job_id: str, workdir: str, env: Mapping[str, str], rec: Mapping[str, object],
           command: str) -> str:
    """The step script of an exec: the cluster variables, the site's modules and python, then
    the command in the workdir."""
    modules = rec.get("modules")
    return steps.step_script(job_id, workdir, env,
                             [str(m) for m in modules] if isinstance(modules, list) else [],
                             str(rec["python"]) if rec.get("python") else None, command)
