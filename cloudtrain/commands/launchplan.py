"""``launch --dry-run``: the plan as ``up --dry-run`` prints it, whether the cluster is
reused or created, what would run (the command, the nodes, the environment's names) and the
budget check. Creates nothing and contacts no node.

Only click is imported at module level.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cloudtrain.context import Env
    from cloudtrain.overrides import Change
    from cloudtrain.pipeline.request import Launch
    from cloudtrain.taskmodel import Task


def show(env: Env, req: Launch, changes: list[Change]) -> None:
    """Print what ``launch`` would do for ``req`` (a UserError, exit 2, when the budget check
    refuses it, as launch itself would)."""
    from cloudtrain.commands.cluster import print_plan

    ui = env.ui
    print_plan(ui, req.plan, req.name, changes,
               req.task.container.image if req.task.container else None)
    existing = env.state.get_cluster(req.name)
    ui.info(f"  {'cluster':<13}" + (f"'{req.name}' is reused ({existing.status}, "
                                     f"{existing.num_nodes} node(s))" if existing else
                                     f"'{req.name}' would be created"))
    ui.info("  would run:")
    for line in run_lines(req.task):
        ui.info(f"    {line}")
    ui.info(f"  {'on nodes':<13}{req.task.num_nodes} node(s)"
            + (" (the cluster's: it has its own count)" if existing
               and existing.num_nodes != req.task.num_nodes else ""))
    names = sorted({**req.task.envs, **req.overrides})
    ui.info(f"  {'env':<13}{', '.join(names) if names else 'none'}"
            + (" (values not shown)" if names else ""))
    for line in budget_lines(env, req):
        ui.info(f"  {'budget':<13}{line}")
    if req.down_after:
        ui.info(f"  {'afterwards':<13}the cluster is torn down (--down)")


def run_lines(task: Task) -> list[str]:
    """The job's command as the nodes would run it: ``run:`` as written, or the train entry."""
    if task.train is not None:
        t = task.train
        entry = ["-m", t.module] if t.module else [t.script or ""]
        words = ["torchrun", f"--nproc-per-node={t.nproc_per_node}", *entry, *t.args]
        lines = [shlex.join(words) + "   (train:, with the rendezvous options added per node)"]
    elif task.run:
        lines = task.run.rstrip("\n").splitlines()
    else:
        lines = ["(nothing: the task has neither run: nor train:)"]
    if task.setup:
        lines.insert(0, f"setup: {len(task.setup.splitlines())} line(s) first, on every node")
    return lines


def budget_lines(env: Env, req: Launch) -> list[str]:
    """The budget check launch makes before anything is created (the estimate, or its
    refusal, raised)."""
    from cloudtrain.pipeline import job, rules
    from cloudtrain.pipeline.lastseen import saved

    limit = rules.in_force(saved(env, req.name), req.budget, req.no_budget)
    if limit is None:
        return ["none" + (" (--no-budget)" if req.no_budget else
                          " (set max_cost_usd in the task, or --max-cost)")]
    job.check_estimate(env, req.name, req.plan, limit)   # prints the estimate, or refuses
    return [f"${limit.max_cost_usd:.2f} for the cluster; the launch is within it"]
