"""The recovery controller (``launch --recover``, issue 13): follow the job as a launch does
and, every ``recovery.poll_seconds``, ask the CLOUD which nodes it took
(``provider.node_health``). Only the cloud's word is a loss: a node whose SSH drops while the
cloud says it runs is left to the reconnect logic of the log follower. On a loss: stop the
surviving ranks (SIGTERM, stop_grace: they write a checkpoint), discard the lost ranks,
provision again (``pipeline.provision``: same place first, the planner's failover order when
that has no capacity and ``failover`` allows it), bootstrap and sync the new nodes, and start
the job again under a new job id (it resumes from the newest checkpoint). Every recovery is a
row of the ledger (``state.recoveries``) with its seconds lost by phase and its dollars."""

from __future__ import annotations

import shlex
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, JobFailed, UserError
from cloudtrain.pipeline import run
from cloudtrain.provider.contract import NodeHealth, Plan, ReportsNodeHealth
from cloudtrain.remote import Group, bash
from cloudtrain.spec import Task
from cloudtrain.taskmodel import Recovery


@dataclass
class Loss:
    """What the cloud said it took, and when the controller saw it."""

    ranks: list[int]
    reason: str
    last_running_at: float
    detected_at: float
    work_since: float
    """The job's start or its last checkpoint, whichever is later: work after it is lost."""


@dataclass
class HealthWatch:
    """A thread asking the provider about the nodes every ``poll`` seconds while a job runs;
    it also carries the launch's budget watch (``run_task`` takes one guard). On a loss it
    stops the job (the surviving ranks get SIGTERM and stop_grace) and ends the log follow."""

    env: Env
    handle: Handle
    group: Group
    poll: float
    task: Task
    watch: budget.Watch | None = None
    head_log: Callable[[], object] | None = None
    """The head's job log on this machine: its ``store.py watch`` says there when a checkpoint
    reached the bucket, which is all that survives the loss of the head."""
    loss: Loss | None = None
    uploaded_at: float | None = None
    _log_offset: int = 0
    started_at: float = field(default_factory=time.time)
    last_running_at: float = field(default_factory=time.time)
    exceeded: threading.Event = field(default_factory=threading.Event)
    _stop: Callable[[str], None] | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if self.watch is not None:
            self.exceeded = self.watch.exceeded

    def error(self) -> budget.BudgetExceeded:
        assert self.watch is not None
        return self.watch.error()

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()
        self._thread = threading.Thread(target=self._loop, name="health-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self.watch is not None:
            self.watch.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def attach(self, stop: Callable[[str], None]) -> None:
        self._stop = stop
        self.started_at = time.time()
        if self.watch is not None:
            self.watch.attach(stop)

    def detach(self) -> None:
        self._stop = None
        if self.watch is not None:
            self.watch.detach()

    def _loop(self) -> None:
        while not self._done.wait(self.poll):
            try:
                health = ask(self.handle)
            except CloudtrainError as exc:   # the cloud could not be asked: not a loss
                self.env.ui.warn(f"recovery: could not ask the cloud about the nodes: {exc}")
                continue
            lost = [h for h in health if h.state == "lost"]
            if not lost:
                before, self.last_running_at = self.last_running_at, time.time()
                self._note_uploads(before)
                continue
            if self._stop is None:
                continue    # between steps: run_task fails on its own, or the next job sees it
            ckpt = None
            if any(h.rank == 0 for h in lost):     # the head's disk is gone: only the bucket's
                ckpt = self.uploaded_at if self.task.checkpoints else None
            else:
                try:
                    ckpt = last_checkpoint_at(self.group, self.handle, self.task)
                except CloudtrainError:
                    ckpt = None
            self.loss = Loss([h.rank for h in lost], "; ".join(f"node {h.rank}: {h.reason}"
                                                             for h in lost),
                             self.last_running_at, time.time(),
                             max(self.started_at, ckpt or 0.0))
            self.env.ui.warn(f"recovery: the cloud took {self.loss.reason}")
            self._stop(f"the cloud took node(s) {self.loss.ranks}")
            self.group.stop.set()   # the lost node's follow ends now, not at the node timeout
            return

    def _note_uploads(self, before: float) -> None:
        """When the head's log (read on from where the last poll stopped) says a checkpoint
        was uploaded, count it from the poll before (the upload ended after that one)."""
        from pathlib import Path

        path = self.head_log() if self.head_log is not None else None
        if not self.task.checkpoints or not isinstance(path, Path):
            return
        try:
            with path.open("rb") as f:
                f.seek(self._log_offset)
                new = f.read()
        except OSError:
            return
        cut = new.rfind(b"\n") + 1
        self._log_offset += cut
        if b"[store] Uploaded checkpoint " in new[:cut]:
            self.uploaded_at = before


def ask(handle: Handle) -> list[NodeHealth]:
    provider = handle.provider
    if not isinstance(provider, ReportsNodeHealth):
        raise UserError(f"The {provider.name} provider cannot tell which nodes the cloud took, "
                        "so --recover cannot run on it.", "Launch without --recover.")
    return provider.node_health(handle.name)


def lost_now(handle: Handle, health: HealthWatch) -> Loss | None:
    """A step before the job (sync, setup) failed: was it the cloud taking a node? Asked once,
    so that the loss, not the failed step, decides what happens."""
    try:
        lost = [h for h in ask(handle) if h.state == "lost"]
    except CloudtrainError:
        return None
    if not lost:
        return None
    now = time.time()
    return Loss([h.rank for h in lost], "; ".join(f"node {h.rank}: {h.reason}" for h in lost),
                health.last_running_at, now, now)


def check(env: Env, task: Task, plan: Plan) -> Recovery:
    """The task's recovery settings (defaults for a bare --recover); refuses a provider that
    cannot report node health (exit 2, before anything is created)."""
    provider = env.provider(plan.provider or task.resources.provider or "local")
    if not isinstance(provider, ReportsNodeHealth):
        raise UserError(f"--recover needs a provider that reports node health; "
                        f"'{provider.name}' does not.",
                        "Launch without --recover, or pick aws, gcp, azure or local.")
    return task.recovery or Recovery()


def last_checkpoint_at(group: Group, handle: Handle, task: Task) -> float | None:
    """When the surviving head last wrote a checkpoint: the newest file under its
    CLOUDTRAIN_CHECKPOINT_DIR (``checkpoints:``'s directory, or the task envs' value) on
    rank 0, or None."""
    from cloudtrain.pipeline import storage

    where = (storage.checkpoint_dir(handle.nodes[0]) if task.checkpoints
             else task.envs.get("CLOUDTRAIN_CHECKPOINT_DIR"))
    if not where or 0 not in group.conns:
        return None
    d = shlex.quote(where)
    res = group.run(bash(f"cd {shlex.quote(handle.nodes[0].root_dir)}/workdir 2>/dev/null; "
                         f"find {d} -type f -printf '%T@\\n' 2>/dev/null | sort -n | tail -1"),
                    ranks=[0], timeout=15)
    try:
        return float(res[0].stdout.strip())
    except (ValueError, KeyError):
        return None


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
                                              loss.reason)
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
            except CloudtrainError:
                if health.exceeded.is_set():
                    raise       # the budget, not the loss, ends the launch
                health.loss = health.loss or lost_now(handle, health)
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
