"""The whole chain, for ``up`` and ``launch``: provision -> wait for SSH -> bootstrap, and for
a launch then sync -> setup -> run on every node, under the budget watch, with the shielded
teardown of ``--down`` (also when the budget is reached). A failed job is raised as
:class:`~cloudtrain.errors.JobFailed`, in words (a spot interruption is named as such)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, JobFailed, UserError
from cloudtrain.pipeline import follower, guard, rules, run
from cloudtrain.pipeline.bootstrap import run_bootstrap
from cloudtrain.pipeline.provision import opened, roll_back
from cloudtrain.pipeline.signals import Shielded
from cloudtrain.pipeline.teardown import down_shielded
from cloudtrain.provider.contract import Plan
from cloudtrain.remote import Group, GroupResult, Result

if TYPE_CHECKING:
    from cloudtrain.spec import Task   # annotations only: no pydantic at import


def up(env: Env, task: Task, name: str, *, bootstrap: bool = True,
       keep_on_failure: bool = False, planned: Plan | None = None) -> Handle:
    """Provision (adopting what exists), wait for SSH on every node, bootstrap. A cluster this
    call created is rolled back when a step fails (unless ``keep_on_failure``). A cluster
    whose nodes stopped themselves is reconciled first (ledger closed when they stopped)."""
    guard.reconcile(env, name)
    with opened(env, task, name, keep_on_failure=keep_on_failure, planned=planned) as (
            handle, group, fresh):
        env.ui.ok(f"SSH up on {len(handle.nodes)} node(s)")
        guard.install(env, handle, group, task, fresh=fresh)
        if bootstrap:
            env.ui.step("Bootstrapping")
            try:
                run_bootstrap(env, handle, group, task.bootstrap)
            except BaseException:
                if fresh and not keep_on_failure:
                    roll_back(env, handle.provider, name)
                raise
    return handle


def launch_budget(task: Task, *, detach: bool, down_after: bool, max_cost: float | None,
                  hours: float | None, no_budget: bool) -> budget.Budget | None:
    """The launch's budget (the task's, or the options'), checked against the options before
    anything is opened or created. With -d the nodes' guards enforce it (and --down)."""
    return budget.resolve(task.max_cost_usd, task.max_hours, max_cost=max_cost, hours=hours,
                          no_budget=no_budget)


def attached_grace() -> tuple[float, float]:
    """Seconds the node guards leave an attached launch to end the job itself (pull outputs,
    tear down) after the job ended / the budget was reached, before acting on their own."""
    import os

    v = os.environ.get("CLOUDTRAIN_GUARD_ATTACHED_GRACE")
    return (float(v), float(v)) if v else (300.0, 60.0)


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


def launch(env: Env, task: Task, name: str, plan: Plan, *, down_after: bool, detach: bool,
           overrides: dict[str, str], limit: budget.Budget | None,
           confirm: Callable[[Plan], None], now: bool = False,
           no_budget: bool = False) -> run.Outcome:
    """Run ``task`` on cluster ``name``: up if needed (``confirm`` asks before a new cluster
    is paid for), sync, setup, run on every node and follow it. With ``down_after``, or when
    the budget ``limit`` is reached, the cluster is torn down at the end, whatever happened.
    Returns the outcome of a job that succeeded (or was started detached); raises JobFailed
    for one that failed, BudgetExceeded when the budget stopped it."""
    guard.reconcile(env, name)
    own = limit
    limit = rules.in_force(guard.saved(env, name), limit, no_budget)
    if own is not None and limit is not None:
        check_estimate(env, name, plan, limit)
    if env.state.get_cluster(name) is None:
        confirm(plan)
    over: budget.BudgetExceeded | None = None
    interrupted: list[str] = []
    started = keep_up = False
    before = guard.saved(env, name)
    try:
        try:
            with opened(env, task, name, planned=plan) as (handle, group, fresh):
                prep: dict[int, run.NodeFacts] = {}
                job_id = on_nodes(env, handle, group, task, down_after=down_after,
                                  detach=detach, limit=own, facts=prep, no_budget=no_budget)
                if fresh:
                    bootstrap_or_roll_back(env, handle, group, task, name)
                watch = None if limit is None or detach else budget.Watch(
                    env.state, name, limit.max_cost_usd, env.ui)
                with follower.Heartbeat(handle, group, job_id, down_after and not detach):
                    try:
                        outcome = run.run_task(env, handle, group, task, detach=detach,
                                               overrides=overrides, guard=watch, job_id=job_id,
                                               now=now, prep=None if fresh else prep)
                    except UserError:
                        # Refused before its job started on a cluster that was there (--now,
                        # a change under a busy cluster): its rules are taken back, and its
                        # --down tears nothing down.
                        keep_up = not fresh and rules_back(env, handle, group, before)
                        raise
                    started = True
                    if down_after and not detach:
                        keep_up = queued_after(env, handle, group, job_id)
                if outcome.exit_code != 0 and handle.row.use_spot:
                    interrupted = interruptions(handle, name)
        except budget.BudgetExceeded as exc:
            over = exc
            env.state.mark_usage_end(name, exc.reason)   # the ledger's reason, once it is down
    finally:
        # A detached job's --down is the nodes' (job end); the CLI tears down only when the
        # job never started (unless refused on a cluster that was there: keep_up).
        if (down_after and not (detach and started) and not keep_up) or over is not None:
            try:
                down_shielded(env, name, plan.provider or task.resources.provider or "local")
            except CloudtrainError:
                if over is not None:
                    env.ui.error(f"The budget was reached ({over.reason}) and the job stopped, "
                                 f"but the cluster is still up: run 'cloudtrain down {name}'.")
                raise
    if over is not None:
        raise over
    if outcome.exit_code != 0:
        raise job_failed(outcome, name, interrupted)
    return outcome


def on_nodes(env: Env, handle: Handle, group: Group, task: Task, *, down_after: bool,
             detach: bool, limit: budget.Budget | None,
             facts: dict[int, run.NodeFacts] | None = None, no_budget: bool = False) -> str:
    """The launch's rules on the node guards (job-end stop for --down, the budget), composed
    with the cluster's (pipeline/rules.py), before the job starts: they hold when this CLI is
    gone. ``limit``: the launch's own budget. With ``facts`` (filled in), the same round trip
    asks each node what run_task needs to know (bootstrapped? synced? set up?). Says the
    budget in force; returns the job's id."""
    from cloudtrain.pipeline.remote_job import new_job_id

    job_id = new_job_id()
    job_end, over = (0.0, 0.0) if detach else attached_grace()
    own = None if limit is None else limit.max_cost_usd
    asked = rules.LaunchRules(
        job_id, own, "max_cost_usd" if own is not None and own == task.max_cost_usd
        else "--max-cost", no_budget, down_after, None if detach else job_end)
    raw: dict[int, Result] = {}
    pol = guard.update(env, handle, group, task, mode="install", budget_grace_s=over,
                       then=None if facts is None else run.prep_command(handle, task), raw=raw,
                       **rules.compose(guard.saved(env, handle.name), asked))
    env.state.set_budget(handle.name, pol.get("max_cost_usd"))
    env.ui.info(f"Budget in force on '{handle.name}': {rules.budget_words(pol)}")
    if facts is not None:
        facts.update(run.prep_facts(GroupResult(sorted(raw.items()))))
    return job_id


def rules_back(env: Env, handle: Handle, group: Group, before: dict[str, Any]) -> bool:
    """A refused launch's rules taken back: the budget and job-end stops as they were
    before it. Returns True (the cluster stays as it is: its --down does not apply)."""
    try:
        guard.update(env, handle, group, None, **{k: before.get(k) for k in rules.COMPOSED})
    except CloudtrainError as exc:
        env.ui.warn(f"could not take back the refused launch's rules on the nodes: {exc}")
    env.state.set_budget(handle.name, before.get("max_cost_usd"))
    return True


def queued_after(env: Env, handle: Handle, group: Group, job_id: str) -> bool:
    """An attached ``--down`` job has ended: when another job runs or waits on the cluster
    (queued after it), the cluster stays up for it and its nodes go down once nothing runs
    or waits (the job is in the guards' down_on_end). True when so (and says so)."""
    from cloudtrain.pipeline import queue

    try:
        others = [r for r in queue.active(queue.records(handle, group)) if r["id"] != job_id]
    except CloudtrainError:
        return False
    if others:
        env.ui.info(f"'{handle.name}' stays up: job {others[0]['id']} "
                    f"({others[0].get('state')}) came after this one and goes first; the "
                    "nodes tear the cluster down once nothing runs or waits (--down).")
    return bool(others)


def bootstrap_or_roll_back(env: Env, handle: Handle, group: Group, task: Task, name: str) -> None:
    """A cluster this launch created is bootstrapped here; when that fails or is interrupted,
    what was created is removed again (as 'up' does), before the error is reported."""
    env.ui.step("Bootstrapping")
    try:
        run_bootstrap(env, handle, group, task.bootstrap)
    except BaseException:
        with Shielded():
            group.close()
            roll_back(env, handle.provider, name)
        raise


def interruptions(handle: Any, name: str) -> list[str]:
    """What the provider says it took back (spot interruptions), in words; [] when it cannot
    tell."""
    from cloudtrain.provider.contract import ReportsInterruptions

    if not isinstance(handle.provider, ReportsInterruptions):
        return []
    try:
        return [str(x) for x in handle.provider.interruptions(name)]
    except CloudtrainError:
        return []


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
    who = f"global rank {outcome.failed_rank} on node {outcome.failed_node}" \
        if outcome.failed_rank is not None else f"node {outcome.failed_node}"
    return JobFailed(outcome.exit_code, outcome.failed_node,
                     f"The job failed: {who} exited with code {outcome.exit_code}; the other "
                     "nodes were stopped.",
                     f"See 'cloudtrain logs {name} --node {outcome.failed_node}'.")
