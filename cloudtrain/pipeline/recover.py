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
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, JobFailed, UserError
from cloudtrain.pipeline import run
from cloudtrain.pipeline.attempt import Tried, attempt
from cloudtrain.pipeline.bootstrap import run_bootstrap
from cloudtrain.pipeline.recover_watch import (HealthWatch, Loss, lost_now,
                                               no_checkpoints_warning, recovery_hold,
                                               unresponsive_window)
from cloudtrain.pipeline.request import Launch
from cloudtrain.provider.contract import Plan, ReportsNodeHealth
from cloudtrain.remote import Group
from cloudtrain.connection import NodeLost

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import
    from cloudtrain.taskmodel import Recovery


def check(env: Env, task: Task, plan: Plan, *, warn: bool = True) -> Recovery:
    """The task's recovery settings (defaults for a bare --recover); refuses a provider that
    cannot report node health and a bad CLOUDTRAIN_UNRESPONSIVE_WINDOW or
    CLOUDTRAIN_RECOVERY_HOLD (exit 2, before anything is created); warns (``warn``) when the
    task has no ``checkpoints:``."""
    from cloudtrain.taskmodel import Recovery

    provider = env.provider(plan.provider or task.resources.provider or "local")
    if not isinstance(provider, ReportsNodeHealth):
        raise UserError(f"--recover needs a provider that reports node health; "
                        f"'{provider.name}' does not.",
                        "Launch without --recover, or pick aws, gcp, azure or local.")
    unresponsive_window()
    recovery_hold()
    if warn and not task.checkpoints:
        env.ui.warn(no_checkpoints_warning())
    return task.recovery or Recovery.model_validate({})   # the defaults: a bare --recover


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


def controlled(env: Env, req: Launch, limit: budget.Budget | None, rec: Recovery) -> Tried:
    """``launch --recover``: the attempts of ``job.launch``, with lost nodes replaced and the
    job restarted, up to ``rec.max_recoveries`` times (the chain around them, with its
    teardown, is job.launch's)."""
    return Controller(env, req, limit, rec).loop()


@dataclass
class Controller:
    """The recovery controller: loops :func:`~cloudtrain.pipeline.attempt.attempt` (it is
    that function's :class:`~cloudtrain.pipeline.attempt.Replacing`), one attempt per loss."""

    env: Env
    req: Launch
    limit: budget.Budget | None
    rec: Recovery
    launch_job: str | None = None
    count: int = 0
    pending: tuple[int, Loss] | None = None      # (recovery id, what was lost)
    superseded: str | None = None                # the job the last loss stopped
    health: HealthWatch | None = None            # this attempt's
    phases: dict[str, float] = field(default_factory=dict)
    t_open: float = 0.0
    t_ready: float = 0.0

    @property
    def name(self) -> str:
        return self.req.name

    def loop(self) -> Tried:
        while True:
            self.phases, self.health = {}, None
            tried = attempt(self.env, self.req, self.limit, self)
            if tried.outcome is None:
                return tried
            outcome = tried.outcome
            self.launch_job = self.launch_job or outcome.job_id
            loss = None if self.health is None else self.health.loss
            if self.pending is not None:
                self.finish(self.pending[0], self.pending[1], outcome.job_id, self.phases)
            if loss is None:
                return tried
            self.replace(outcome, loss)

    def replace(self, outcome: run.Outcome, loss: Loss) -> None:
        """The loss recorded (a row of the ledger), the lost nodes discarded: the next
        attempt provisions them again; past max_recoveries, the launch gives up."""
        self.env.state.finish_launch(outcome.job_id, "PREEMPTED", None, loss.ranks[0],
                                     loss.reason)
        self.superseded = outcome.job_id
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
        provider = self.env.provider(self.req.provider)
        assert isinstance(provider, ReportsNodeHealth)   # check() refused any other
        provider.discard_nodes(self.name, loss.ranks)
        self.pending = (rid, loss)

    @contextmanager
    def opened(self) -> Iterator[tuple[Handle, Group, bool]]:
        """``opened`` for this attempt; a replacement that finds no capacity where the
        cluster is moves the whole cluster along the planner's failover order when allowed.
        A silent node is waited for (the unresponsive window), not lost."""
        with self._provisioned() as (handle, group, fresh):
            group.patience = unresponsive_window()
            self.t_open = time.time()
            if self.pending is not None:
                self.phases["replace_s"] = self.t_open - self.pending[1].detected_at
            yield handle, group, fresh

    @contextmanager
    def _provisioned(self) -> Iterator[tuple[Handle, Group, bool]]:
        from cloudtrain import planner
        from cloudtrain.errors import CapacityError, QuotaError
        from cloudtrain.pipeline.provision import opened
        from cloudtrain.pipeline.teardown import down_shielded

        env, task, again = self.env, self.req.task, self.pending is not None
        try:
            with opened(env, task, self.name, planned=None if again else self.req.plan) as got:
                yield got
                return
        except (CapacityError, QuotaError) as exc:
            if not (again and self.rec.failover and planner.needs_pick(task)):
                raise
            env.ui.warn(f"recovery: no replacement where the cluster is ({exc.message}); "
                        "moving the cluster along the planner's failover order.")
            down_shielded(env, self.name, self.req.plan.provider or "local")
        with opened(env, task, self.name, planned=self.req.plan) as got:
            yield got

    def ready(self, handle: Handle, group: Group, fresh: bool) -> bool:
        """The replacement nodes bootstrapped (a fresh cluster was, by the attempt)."""
        replaced = not fresh and self.pending is not None
        if replaced:
            self.env.ui.step("Bootstrapping the replacement node(s)")
            run_bootstrap(self.env, handle, group, self.req.task.bootstrap,
                          container=self.req.task.container is not None)
        self.t_ready = time.time()
        self.phases["bootstrap_s"] = self.t_ready - self.t_open
        return replaced

    def run(self, handle: Handle, group: Group, task: Task, start: run.JobStart,
            watch: budget.Watch | None) -> run.Outcome:
        """run_task under the health watch; a loss the cloud reports (or a node silent past
        the window) is the attempt's outcome, not the error it caused."""
        job_id = start.job_id
        head_log = lambda: self.env.logs_dir(self.name) / job_id / "node-0.log"  # noqa: E731 - a named one-line callable, read once below
        health = self.health = HealthWatch(
            self.env, handle, group, self.rec.poll_seconds, task, watch, head_log,
            on_loss=lambda loss: self.hold(handle, group, job_id, loss))
        done = threading.Event()
        first = first_line_at(head_log, done)
        try:
            outcome = run.run_task(self.env, handle, group, task, start, health)
        except CloudtrainError as exc:
            if health.exceeded.is_set():
                raise       # the budget, not the loss, ends the launch
            health.loss = health.loss or lost_now(handle, health)
            if health.loss is None and isinstance(exc, NodeLost):
                health.loss = health.unresponsive(exc, group.patience or unresponsive_window())
            if health.loss is None:
                raise
            self.hold(handle, group, job_id, health.loss)
            outcome = run.Outcome(job_id, 1)    # the loss, not the error, is the story
        finally:
            done.set()
        self.phases["sync_s"] = max(0.0, health.started_at - self.t_ready)
        if first:
            self.phases["restart_s"] = max(0.0, first[0] - health.started_at)
        return outcome

    def hold(self, handle: Handle, group: Group, job_id: str, loss: Loss) -> None:
        """A ``--down`` job stopped by a loss is no job end: the survivors' guards hold its
        rule for the recovery hold (they go down then if this CLI is gone by then); the next
        attempt's job supersedes it. Once per loss; a failure is said, not raised."""
        from cloudtrain.pipeline import guard as node_guard, rules
        from cloudtrain.pipeline.lastseen import saved

        changes = rules.held(saved(self.env, self.name), job_id, time.time() + recovery_hold())
        if not changes or loss.held:
            return
        loss.held = True
        alive = [n.rank for n in group.nodes if n.rank not in loss.ranks]
        try:
            node_guard.update(self.env, handle, group, None, ranks=alive, **changes)
        except CloudtrainError as exc:
            self.env.ui.warn(f"recovery: could not hold job {job_id}'s --down rule on the "
                             f"surviving nodes ({exc}); they may go down before the "
                             "replacement is ready")

    def finish(self, rid: int, loss: Loss, new_job: str, phases: dict[str, float]) -> None:
        """The recovery's row: seconds lost by phase, and the dollars (lost work: node-hours
        since the last checkpoint; replacement: the cluster's node-hours from the loss to
        training again) at the cluster's price."""
        row = self.env.state.get_cluster(self.name)
        price = (row.hourly_price or 0.0) if row else 0.0
        nodes = row.num_nodes if row else self.req.task.num_nodes
        detect = loss.detected_at - loss.last_running_at
        total = detect + sum(phases.values())
        self.env.state.update_recovery(
            rid, new_job=new_job, detect_s=detect, status="RECOVERED",
            lost_work_usd=nodes * price * max(0.0, loss.detected_at - loss.work_since) / 3600,
            replacement_usd=nodes * price * total / 3600, **phases)
        self.env.ui.ok(f"Recovered: job {new_job} resumed {total:.1f} s after the loss "
                       f"(detect {detect:.1f} s, " + ", ".join(
                           f"{k[:-2]} {v:.1f} s" for k, v in phases.items()) + ")")


def detached(env: Env, req: Launch) -> None:
    """``launch -d --recover``: confirmed here, then the controller runs in the background
    on this machine (``cloudtrain jobs``), from the request's command line."""
    from cloudtrain.pipeline import controllers

    if env.state.get_cluster(req.name) is None:
        req.confirm(req.plan)
    rec = controllers.spawn(req)
    env.ui.ok(f"Recovery controller {rec['id']} started in the background (pid {rec['pid']}) "
              f"for '{req.name}'. Follow it: cloudtrain jobs logs {rec['id']} -f; stop it: "
              f"cloudtrain jobs cancel {rec['id']}")
