"""``cloudtrain sweep SWEEP.yaml --recover`` (or ``recovery:`` in the task): the sweep under
the recovery controller of ``launch --recover`` (pipeline/recover.py), not a loop of its own.
Each attempt (pipeline/attempt.py) provisions and bootstraps as a launch's does; this
controller's ``run`` hook, instead of running a job, sends the workdir, puts the sweep's rules
on the node guards, starts the driver on the head and follows the sweep until it has
finished, under the same health watch. When the cloud takes the head (local nodes: its sshd
exits), the controller replaces it, and the next attempt starts the driver on the new head,
which first restores the study from the journal the lost head kept in the task's
``checkpoints:`` bucket (node/sweepkeep.py): the trials it left running are told FAIL
(``lost``), and the sweep goes on to its total. Without ``checkpoints:`` nothing could resume,
so ``--recover`` on a sweep is refused (exit 2) before anything is created."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, RemoteError, SpecError
from cloudtrain.pipeline import run, sweep as sweeps, sweepnode
from cloudtrain.pipeline.recover import Controller
from cloudtrain.pipeline.recover_watch import HealthWatch, Loss, lost_now, unresponsive_window
from cloudtrain.provider.contract import Plan
from cloudtrain.remote import Group

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def wanted(sw: sweeps.Sweep, asked: bool) -> bool:
    """``--recover`` asked, or ``recovery:`` in the task (as for ``launch``)."""
    return asked or sw.task.recovery is not None


def check(sw: sweeps.Sweep) -> None:
    """A sweep resumes from the journal kept in the task's ``checkpoints:`` bucket: without
    one, exit 2 naming the field and the fix."""
    if not sw.task.checkpoints:
        raise SpecError(
            "is not set in the sweep's task, and a sweep under --recover resumes from the "
            "study its head keeps in that bucket: a replaced head would start with nothing.",
            "Add 'checkpoints: s3://BUCKET/PATH' (or gs://, az://) to the task "
            "(docs/storage.md), or start the sweep without --recover.",
            field="checkpoints", source=str(sw.path.resolve().parent / sw.spec.task))


def start(env: Env, sw: sweeps.Sweep, plan: Plan,
          confirm: Callable[[Plan], None]) -> dict[str, Any] | None:
    """The checks, creating nothing (``checkpoints:``, a provider that reports node health,
    the budget); then this process is the sweep's recovery controller until the sweep has
    finished. Returns the driver's last status document."""
    from cloudtrain.ledger import cluster_spend
    from cloudtrain.pipeline import guard as node_guard, recover
    from cloudtrain.pipeline.request import Launch

    check(sw)
    rec = recover.check(env, sw.task, plan, warn=False)
    existing = env.state.get_cluster(sw.cluster) is not None
    sweeps.check_budget(sw, plan, (cluster_spend(env.state, sw.cluster) or 0.0)
                        if existing else 0.0)
    node_guard.reconcile(env, sw.cluster)
    if not existing:
        confirm(plan)
    ctl = SweepController(env, Launch(sw.task, sw.cluster, plan, recover=True), None, rec,
                          sweep=sw)
    tried = ctl.loop()
    if tried.refused is not None:
        raise tried.refused
    if sw.spec.down:      # the guards leave it to this controller (its attached grace)
        from cloudtrain.pipeline.teardown import down_shielded
        kept(env, sw.name)
        down_shielded(env, sw.cluster, ctl.req.provider)
    return ctl.last


def kept(env: Env, name: str) -> None:
    """The finished sweep's every trial in the ledger before its cluster goes (``sweep
    results`` answers from there afterwards)."""
    from cloudtrain.pipeline import sweepread

    try:
        sweepread.read(env, name)
    except CloudtrainError as exc:
        env.ui.warn(f"could not read the sweep's last results before the teardown: {exc}")


@dataclass
class SweepController(Controller):
    """launch --recover's controller with the sweep in place of the job: ``run`` (the
    attempt's hook) drives the sweep (pipeline/sweep.py ``drive``) and follows it."""

    sweep: sweeps.Sweep | None = None
    recorded: bool = False
    last: dict[str, Any] | None = None

    def replace(self, outcome: run.Outcome, loss: Loss) -> None:
        """As a launch's, unless the cluster has spent the sweep's budget: then the nodes
        went down at the guards' budget stop, which is no loss to replace."""
        from cloudtrain.ledger import cluster_spend

        assert self.sweep is not None
        row = self.env.state.get_cluster(self.name)
        caps = [c for c in (self.sweep.spec.max_cost_usd, row.max_cost_usd if row else None)
                if c is not None]
        cap = min(caps) if caps else None       # the budget in force on the guards
        spent = cluster_spend(self.env.state, self.name)
        if cap is not None and spent is not None and spent >= cap:
            raise budget.BudgetExceeded(self.name, spent, cap)
        super().replace(outcome, loss)

    def run(self, handle: Handle, group: Group, task: Task, start: run.JobStart,
            watch: budget.Watch | None) -> run.Outcome:
        """The sweep on the cluster, followed until it has finished (exit 0) or the cloud
        took a node (exit 1, ``health.loss`` set: the controller replaces it)."""
        assert self.sweep is not None
        health = self.health = HealthWatch(self.env, handle, group, self.rec.poll_seconds,
                                           task, watch)
        taken = threading.Event()
        health.start()
        health.attach(lambda why: taken.set())
        try:
            code = self._driven(handle, group, health, taken)
        finally:
            health.detach()
            health.stop()
        return run.Outcome(start.job_id, code)

    def _driven(self, handle: Handle, group: Group, health: HealthWatch,
                taken: threading.Event) -> int:
        assert self.sweep is not None
        from cloudtrain.pipeline.attempt import attached_grace
        from cloudtrain.pipeline.follower import Heartbeat

        sw = self.sweep
        head_lost = self.pending is None or 0 in self.pending[1].ranks
        try:
            sweeps.drive(self.env, sw, handle, group, record=not self.recorded,
                         driver=head_lost, grace=attached_grace()[0] if sw.spec.down else None)
            self.recorded = True
            self.phases["sync_s"] = max(0.0, time.time() - self.t_ready)
            with Heartbeat(handle, group, sweepnode.driver_job(sw.name), sw.spec.down):
                return self.follow(handle, group, taken)
        except CloudtrainError:
            health.loss = health.loss or lost_now(handle, health)
            if health.loss is None:
                raise
            return 1

    def follow(self, handle: Handle, group: Group, taken: threading.Event) -> int:
        """The driver's status every poll until the sweep has finished (its first answer
        ends the recovery's ``restart_s``); a node the cloud took ends the follow. The head
        silent for longer than the unresponsive window while the cloud says it runs: the
        error is raised."""
        assert self.sweep is not None
        said, silent_since, t0 = "", None, time.time()
        while not taken.wait(self.rec.poll_seconds):
            try:
                doc = sweepnode.document(handle, group, "status", self.sweep.name)
            except CloudtrainError:
                silent_since = silent_since or time.time()
                if time.time() - silent_since > unresponsive_window():
                    raise
                continue
            silent_since, self.last = None, doc
            self.phases.setdefault("restart_s", time.time() - t0)   # the driver answers
            now = progress(doc)
            if now != said:
                self.env.ui.info(now)
                said = now
            if doc.get("finished"):
                return 0
            if not driver_alive(handle, group, self.sweep.name, taken):
                return self.ended_early(handle, group)
        return 1

    def ended_early(self, handle: Handle, group: Group) -> int:
        """The driver is gone: finished meanwhile (0), or it ended before the sweep did (the
        node guard stopped it at the budget, or it failed): said, not recovered."""
        assert self.sweep is not None
        doc = self.last = sweepnode.document(handle, group, "status", self.sweep.name)
        if doc.get("finished"):
            return 0
        raise RemoteError(
            f"The sweep's driver on the head ended before the sweep finished "
            f"({progress(doc)}).",
            f"Its log: {handle.nodes[0].root_dir}/.cloudtrain/sweeps/{self.sweep.name}/"
            f"head.log on the head ('cloudtrain ssh {handle.name}'); 'cloudtrain status "
            f"{handle.name}' says whether the budget stopped it.")


def driver_alive(handle: Handle, group: Group, name: str, taken: threading.Event) -> bool:
    """Whether the driver's process (its pid in ROOT/jobs/sweep-NAME/pid) runs on the head;
    True when that cannot be told (the next poll asks again) or a node was just taken."""
    import shlex

    from cloudtrain.remote import bash

    head = handle.nodes[0]
    line = bash(f"r={shlex.quote(head.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "
                f"kill -0 \"$(cat \"$r/jobs/{sweepnode.driver_job(name)}/pid\")\" 2>/dev/null "
                "&& echo alive || echo gone")
    try:
        res = group.run(line, timeout=60, ranks=[head.rank])[head.rank]
    except CloudtrainError:
        return True
    return taken.is_set() or not res.ok or res.stdout.strip() != "gone"


def progress(doc: dict[str, Any]) -> str:
    """One line of the driver's status: trials ended of the total, by state, the best."""
    counts = doc.get("counts")
    counts = counts if isinstance(counts, dict) else {}
    ended = sum(int(counts.get(s) or 0) for s in ("complete", "pruned", "fail"))
    best, lost = doc.get("best"), doc.get("lost")
    return (f"sweep {doc.get('name')}: {ended}/{doc.get('trials')} trials ended ("
            + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("complete", "pruned", "fail"))
            + f"), {counts.get('running', 0)} running"
            + (f"; best: trial {best.get('number')} = {best.get('value')}"
               if isinstance(best, dict) else "")
            + (f"; lost with a head: {lost}" if isinstance(lost, list) and lost else ""))
