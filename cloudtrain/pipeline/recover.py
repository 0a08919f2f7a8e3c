"""The recovery controller (``launch --recover``, issues 13 and 21): follow the job as a launch
does and, every ``recovery.poll_seconds``, ask the CLOUD which nodes it took
(``provider.node_health``; :mod:`.recover_watch`). Only the cloud's word is a loss at once: a
node whose SSH drops while the cloud says it runs is waited for (the log follower keeps
reconnecting) up to the unresponsive window, then replaced as "unresponsive". On a loss: stop the
surviving ranks (SIGTERM, stop_grace: they write a checkpoint), discard the lost ranks,
provision again (``pipeline.provision``: same place first, the planner's failover order when
that has no capacity and ``failover`` allows it), bootstrap and sync the new nodes, and start
the job again under a new job id (it resumes from the newest checkpoint). Every recovery is a
row of the ledger (``state.recoveries``) with its seconds lost by phase and its dollars."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from cloudtrain import budget
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, JobFailed, UserError
from cloudtrain.pipeline import run
from cloudtrain.pipeline.recover_watch import (HealthWatch, Loss, lost_now,
                                               no_checkpoints_warning, unresponsive_window)
from cloudtrain.provider.contract import Plan, ReportsNodeHealth
from cloudtrain.remote import NodeLost
from cloudtrain.spec import Task
from cloudtrain.taskmodel import Recovery


def check(env: Env, task: Task, plan: Plan, *, warn: bool = True) -> Recovery:
    """The task's recovery settings (defaults for a bare --recover); refuses a provider that
    cannot report node health and a bad CLOUDTRAIN_UNRESPONSIVE_WINDOW (exit 2, before
    anything is created); warns (``warn``) when the task has no ``checkpoints:``."""
    provider = env.provider(plan.provider or task.resources.provider or "local")
    if not isinstance(provider, ReportsNodeHealth):
        raise UserError(f"--recover needs a provider that reports node health; "
                        f"'{provider.name}' does not.",
                        "Launch without --recover, or pick aws, gcp, azure or local.")
    unresponsive_window()
    if warn and not task.checkpoints:
        env.ui.warn(no_checkpoints_warning())
    return task.recovery or Recovery()


def first_line_at(path_of: Callable[[], object], done: threading.Event) -> list[float]:
    """A thread noting when the new job's head log gets its first line (training again)."""
    from pathlib import Path

    out: list[float] = []

    def loop() -> None:
        while not done.wait(0.05):
            p = path_of()
            if isinstance(p, Path) and p.exists() and p.stat().st_size > 0:
                out.append(time.time())
                return

    threading.Thread(target=loop, name="first-line", daemon=True).start()
    return out


def launch(env: Env, task: Task, name: str, plan: Plan, *, down_after: bool,
           overrides: dict[str, str], limit: budget.Budget | None,
           confirm: Callable[[Plan], None]) -> run.Outcome:
    """``launch --recover``, attached: the job as ``job.launch`` runs it, with lost nodes
    replaced and the job restarted, up to ``recovery.max_recoveries`` times."""
    from cloudtrain.pipeline import guard
    from cloudtrain.pipeline import job as chain
    from cloudtrain.pipeline.teardown import down_shielded

    rec = check(env, task, plan)
    guard.reconcile(env, name)
    if limit is not None:
        chain.check_estimate(env, name, plan, limit)
    if env.state.get_cluster(name) is None:
        confirm(plan)
    over: budget.BudgetExceeded | None = None
    ctl = Controller(env, task, name, plan, rec, overrides, limit, down_after)
    try:
        try:
            outcome = ctl.run()
        except budget.BudgetExceeded as exc:
            over = exc
            env.state.mark_usage_end(name, exc.reason)
    finally:
        if down_after or over is not None:
            down_shielded(env, name, plan.provider or task.resources.provider or "local")
    if over is not None:
        raise over
    if outcome.exit_code != 0:
        raise chain.job_failed(outcome, name, [])
    return outcome


@dataclass
class Controller:
    env: Env
    task: Task
    name: str
    plan: Plan
    rec: Recovery
    overrides: dict[str, str]
    limit: budget.Budget | None
    down_after: bool
    launch_job: str | None = None
    count: int = 0

    def run(self) -> run.Outcome:
        pending: tuple[int, Loss] | None = None      # (recovery id, what was lost)
        while True:
            outcome, loss, phases = self.once(pending)
            if pending is not None:
                self.finish(pending[0], pending[1], outcome.job_id, phases)
            if loss is None:
                return outcome
            self.env.state.finish_launch(outcome.job_id, "PREEMPTED", None, loss.ranks[0],
                                         loss.reason)
            self.count += 1
            rid = self.env.state.add_recovery(self.name, self.launch_job or outcome.job_id,
                                              outcome.job_id, loss.last_running_at, loss.ranks,
                                              loss.reason, loss.resumes_from)
            if self.count > self.rec.max_recoveries:
                self.env.state.update_recovery(rid, status="GAVE_UP")
                raise JobFailed(1, loss.ranks[0],
                                f"The cloud took node(s) {loss.ranks} ({loss.reason}), and this "
                                f"launch has already replaced lost nodes "
                                f"{self.rec.max_recoveries} time(s) (recovery.max_recoveries): "
                                "giving up.",
                                "Raise recovery.max_recoveries, or pick on-demand capacity; "
                                f"'cloudtrain status {self.name}' shows the recoveries.")
            self.env.ui.step(f"Recovery {self.count} of at most {self.rec.max_recoveries}: "
                             f"replacing node(s) {loss.ranks}")
            provider = self.env.provider(self.plan.provider or self.task.resources.provider
                                         or "local")
            assert isinstance(provider, ReportsNodeHealth)
            provider.discard_nodes(self.name, loss.ranks)
            pending = (rid, loss)

    def once(self, pending: tuple[int, Loss] | None
             ) -> tuple[run.Outcome, Loss | None, dict[str, float]]:
        """Provision (replacing what was discarded), bootstrap, run and follow the job once."""
        from cloudtrain.pipeline import job as chain
        from cloudtrain.pipeline.bootstrap import run_bootstrap
        from cloudtrain.pipeline.provision import opened

        phases: dict[str, float] = {}
        with self.provisioned(opened, pending is not None) as (handle, group, fresh):
            group.patience = unresponsive_window()   # a silent node is waited for, not lost
            t = time.time()
            if pending is not None:
                phases["replace_s"] = t - pending[1].detected_at
            job_id = chain.on_nodes(self.env, handle, group, self.task,
                                    down_after=self.down_after, detach=False, limit=self.limit)
            self.launch_job = self.launch_job or job_id
            if fresh:
                chain.bootstrap_or_roll_back(self.env, handle, group, self.task, self.name)
            elif pending is not None:
                self.env.ui.step("Bootstrapping the replacement node(s)")
                run_bootstrap(self.env, handle, group, self.task.bootstrap)
            t2 = time.time()
            phases["bootstrap_s"] = t2 - t
            watch = None if self.limit is None else budget.Watch(
                self.env.state, self.name, self.limit.max_cost_usd, self.env.ui)
            head_log = lambda: self.env.logs_dir(self.name) / job_id / "node-0.log"  # noqa: E731
            health = HealthWatch(self.env, handle, group, self.rec.poll_seconds, self.task,
                                 watch, head_log)
            done = threading.Event()
            first = first_line_at(head_log, done)
            try:
                outcome = run.run_task(self.env, handle, group, self.task,
                                       overrides=self.overrides, guard=health, job_id=job_id)
            except CloudtrainError as exc:
                if health.exceeded.is_set():
                    raise       # the budget, not the loss, ends the launch
                health.loss = health.loss or lost_now(handle, health)
                if health.loss is None and isinstance(exc, NodeLost):
                    health.loss = health.unresponsive(exc, group.patience)
                if health.loss is None:
                    raise
                outcome = run.Outcome(job_id, 1)    # the loss, not the error, is the story
            finally:
                done.set()
            phases["sync_s"] = max(0.0, health.started_at - t2)
            if first:
                phases["restart_s"] = max(0.0, first[0] - health.started_at)
        return outcome, health.loss, phases

    def provisioned(self, opened: Callable[..., object], again: bool):  # type: ignore[no-untyped-def]
        """``opened`` for this launch; a replacement that finds no capacity where the cluster
        is moves the whole cluster along the planner's failover order when allowed."""
        from contextlib import contextmanager

        from cloudtrain import planner
        from cloudtrain.errors import CapacityError, QuotaError
        from cloudtrain.pipeline.teardown import down_shielded

        @contextmanager
        def cm():  # type: ignore[no-untyped-def]
            try:
                with opened(self.env, self.task, self.name,  # type: ignore[operator]
                            planned=None if again else self.plan) as got:
                    yield got
                    return
            except (CapacityError, QuotaError) as exc:
                if not (again and self.rec.failover and planner.needs_pick(self.task)):
                    raise
                self.env.ui.warn(f"recovery: no replacement where the cluster is ({exc.message}); "
                                 "moving the cluster along the planner's failover order.")
                down_shielded(self.env, self.name, self.plan.provider or "local")
            with opened(self.env, self.task, self.name, planned=self.plan) as got:  # type: ignore[operator]
                yield got

        return cm()

    def finish(self, rid: int, loss: Loss, new_job: str, phases: dict[str, float]) -> None:
        """The recovery's row: seconds lost by phase, and the dollars (lost work: node-hours
        since the last checkpoint; replacement: the cluster's node-hours from the loss to
        training again) at the cluster's price."""
        row = self.env.state.get_cluster(self.name)
        price = (row.hourly_price or 0.0) if row else 0.0
        nodes = row.num_nodes if row else self.task.num_nodes
        detect = loss.detected_at - loss.last_running_at
        total = detect + sum(phases.values())
        self.env.state.update_recovery(
            rid, new_job=new_job, detect_s=detect, status="RECOVERED",
            lost_work_usd=nodes * price * max(0.0, loss.detected_at - loss.work_since) / 3600,
            replacement_usd=nodes * price * total / 3600, **phases)
        self.env.ui.ok(f"Recovered: job {new_job} resumed {total:.1f} s after the loss "
                       f"(detect {detect:.1f} s, " + ", ".join(
                           f"{k[:-2]} {v:.1f} s" for k, v in phases.items()) + ")")


def detached(env: Env, task: Task, name: str, plan: Plan, *, down_after: bool,
             overrides: dict[str, str], confirm: Callable[[Plan], None], task_file: str,
             max_cost: float | None, hours: float | None, no_budget: bool) -> None:
    """``launch -d --recover``: checked and confirmed here, then the controller runs in the
    background on this machine (``cloudtrain jobs``)."""
    from pathlib import Path

    from cloudtrain.pipeline import controllers

    check(env, task, plan)
    if env.state.get_cluster(name) is None:
        confirm(plan)
    rec = controllers.spawn(Path(task_file), name, down_after=down_after, overrides=overrides,
                            max_cost=max_cost, hours=hours, no_budget=no_budget)
    env.ui.ok(f"Recovery controller {rec['id']} started in the background (pid {rec['pid']}) "
              f"for '{name}'. Follow it: cloudtrain jobs logs {rec['id']} -f; stop it: "
              f"cloudtrain jobs cancel {rec['id']}")
