"""The whole chain, for ``up`` and ``launch``: provision -> wait for SSH -> bootstrap, and for
a launch (:class:`~cloudtrain.pipeline.request.Launch`) the cluster's rules, the budget's
estimate and the confirmation, then one attempt (pipeline/attempt.py: sync -> setup -> run on
every node, under the budget watch) or the recovery controller's attempts (``--recover``,
pipeline/recover.py), with the shielded teardown of ``--down`` (also when the budget is
reached). A failed job is raised as :class:`~cloudtrain.errors.JobFailed`, in words (a spot
interruption is named as such)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, JobFailed
from cloudtrain.pipeline import guard as node_guard, recover as recovery, rules, run
from cloudtrain.pipeline.attempt import Tried, attempt
from cloudtrain.pipeline.bootstrap import run_bootstrap
from cloudtrain.pipeline.lastseen import saved
from cloudtrain.pipeline.provision import opened, provision, roll_back
from cloudtrain.pipeline.request import Launch
from cloudtrain.pipeline.teardown import down_shielded
from cloudtrain.provider.contract import Allocates, Plan

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def up(env: Env, task: Task, name: str, *, bootstrap: bool = True,
       keep_on_failure: bool = False, planned: Plan | None = None) -> Handle:
    """Provision (adopting what exists), wait for SSH on every node, bootstrap. A cluster this
    call created is rolled back when a step fails (unless ``keep_on_failure``). A cluster
    whose nodes stopped themselves is reconciled first (ledger closed when they stopped)."""
    node_guard.reconcile(env, name)
    if allocates(env, task):   # a scheduler's allocation: up ends once it runs (no SSH)
        from cloudtrain.pipeline.stepjobs import guard_up

        handle = provision(env, task, name, keep_on_failure=keep_on_failure, planned=planned)[0]
        guard_up(env, handle, task)    # the task's idle stop, to the allocation's guard
        return handle
    with opened(env, task, name, keep_on_failure=keep_on_failure, planned=planned) as (
            handle, group, fresh):
        env.ui.ok(f"SSH up on {len(handle.nodes)} node(s)")
        node_guard.install(env, handle, group, task, fresh=fresh)
        if bootstrap:
            env.ui.step("Bootstrapping")
            try:
                run_bootstrap(env, handle, group, task.bootstrap,
                              container=task.container is not None)
            except BaseException:
                if fresh and not keep_on_failure:
                    roll_back(env, handle.provider, name)
                raise
    return handle


def allocates(env: Env, task: Task) -> bool:
    """Whether the task's provider is a scheduler's allocation (contract.Allocates)."""
    name = task.resources.provider
    return name is not None and issubclass(env.provider_class(name), Allocates)


def check_estimate(env: Env, name: str, plan: Plan, limit: budget.Budget) -> None:
    """Refuse the launch when what the cluster has cost plus its price for the budget's hours
    exceeds the budget; otherwise say how much of it the estimate takes."""
    from cloudtrain.ledger import cluster_spend

    existing = env.state.get_cluster(name)
    estimate = budget.check_before_launch(
        limit, cluster=name,
        price_per_node=existing.hourly_price if existing else plan.hourly_price_per_node,
        num_nodes=existing.num_nodes if existing else plan.num_nodes,
        spent=cluster_spend(env.state, name) if existing else 0.0)
    env.ui.info(f"Estimate for {limit.hours:g} h: ${estimate:.4f} of the "
                f"${limit.max_cost_usd:.4f} budget.")


def launch(env: Env, req: Launch) -> run.Outcome | None:
    """The launch chain: run ``req.task`` on cluster ``req.name``: up if needed
    (``req.confirm`` asks before a new cluster is paid for), sync, setup, run on every node
    and follow it; with ``req.recover``, the recovery controller's attempts (pipeline/
    recover.py), in the background with -d (None is returned). With --down, or when the
    budget in force is reached, the cluster is torn down at the end, whatever happened.
    Returns the outcome of a job that succeeded (or was started detached); raises JobFailed
    for one that failed, BudgetExceeded when the budget stopped it."""
    if allocates(env, req.task):   # a scheduler's allocation: the job is a step of it
        from cloudtrain.pipeline import steps

        return steps.launch(env, req)
    rec = recovery.check(env, req.task, req.plan) if req.recover else None
    if rec is not None and req.detach:
        recovery.detached(env, req)
        return None
    node_guard.reconcile(env, req.name)
    limit = rules.in_force(saved(env, req.name), req.budget, req.no_budget)
    if req.budget is not None and limit is not None:
        check_estimate(env, req.name, req.plan, limit)
    if env.state.get_cluster(req.name) is None:
        req.confirm(req.plan)
    tried = over = None
    try:
        try:
            tried = (recovery.controlled(env, req, limit, rec) if rec is not None
                     else attempt(env, req, limit))
        except budget.BudgetExceeded as exc:
            over = exc
            env.state.mark_usage_end(req.name, exc.reason)   # the ledger's reason, once down
    finally:
        # A detached job's --down is the nodes' (job end); the CLI tears down only when the
        # job never started (unless refused on a cluster that was there: keep_up).
        started = tried is not None and tried.outcome is not None
        keep_up = tried is not None and tried.keep_up
        if (req.down_after and not (req.detach and started) and not keep_up) or over is not None:
            torn_down(env, req, over)
    return ended(req, tried, over)


def torn_down(env: Env, req: Launch, over: budget.BudgetExceeded | None) -> None:
    """The launch's teardown (--down, or the budget reached), shielded from signals."""
    try:
        down_shielded(env, req.name, req.provider)
    except CloudtrainError:
        if over is not None:
            env.ui.error(f"The budget was reached ({over.reason}) and the job stopped, "
                         f"but the cluster is still up: run 'cloudtrain down {req.name}'.")
        raise


def ended(req: Launch, tried: Tried | None, over: budget.BudgetExceeded | None) -> run.Outcome:
    """What the launch ends with, once torn down: the outcome, or the error to raise."""
    if over is not None:
        raise over
    assert tried is not None     # attempt returned (no exception)
    if tried.refused is not None:
        raise tried.refused
    assert tried.outcome is not None
    if tried.outcome.exit_code != 0:
        raise job_failed(tried.outcome, req.name, tried.interrupted)
    return tried.outcome


def job_failed(outcome: run.Outcome, name: str, interrupted: list[str]) -> JobFailed:
    """The error for a job that exited non-zero: a spot interruption when the provider said
    it took capacity back, else the first failing rank and node."""
    if interrupted:
        return JobFailed(outcome.exit_code, outcome.failed_node,
                         "The job stopped because the cloud took back spot capacity: "
                         + "; ".join(interrupted) + ". This is a spot interruption, not a "
                         "crash in your code.",
                         "Run the launch again: up replaces the missing node(s), and a job "
                         "that checkpoints (like the template) resumes where it stopped.")
    from cloudtrain.pipeline import ranklog

    failed = outcome.failure or ranklog.Failed(outcome.failed_node or 0, outcome.failed_rank,
                                               None, outcome.exit_code)
    return JobFailed(outcome.exit_code, outcome.failed_node, ranklog.message(failed),
                     ranklog.where(name, outcome.failed_node, outcome.logs,
                                   ranks=outcome.failure is not None))
