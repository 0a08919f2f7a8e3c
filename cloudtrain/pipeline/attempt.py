"""One attempt at a launch, on the cluster: provision (adopting what exists) and connect, the
launch's rules on the node guards (with the nodes' facts in the same round trip), bootstrap a
cluster it created, then sync, setup, run and follow the job (pipeline/run.py) under the
budget watch and, for ``--down``, the heartbeat to the guards. ``launch`` makes one attempt;
``launch --recover``'s controller (pipeline/recover.py) makes one per replacement, through the
:class:`Replacing` hooks. The chain around it (reconcile, estimate, confirm, the shielded
teardown) is :func:`cloudtrain.pipeline.job.launch`'s."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.containers import pull
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, UserError
from cloudtrain.pipeline import follower, guard as node_guard, rules, run
from cloudtrain.pipeline.bootstrap import run_bootstrap
from cloudtrain.pipeline.lastseen import saved
from cloudtrain.pipeline.policy import Policy
from cloudtrain.pipeline.prep import NodeFacts, prep_command, prep_facts
from cloudtrain.pipeline.provision import opened, roll_back
from cloudtrain.pipeline.request import Launch
from cloudtrain.pipeline.signals import Shielded
from cloudtrain.preflight import flow as preflight
from cloudtrain.remote import Group

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


class Replacing(Protocol):
    """What ``launch --recover`` changes in an attempt (pipeline/recover.py's Controller)."""

    superseded: str | None
    """The job the last loss stopped: this attempt's job takes its rules over."""

    def opened(self) -> AbstractContextManager[tuple[Handle, Group, bool]]:
        """Provision and connect: the plan first, the replacements after a loss."""

    def ready(self, handle: Handle, group: Group, fresh: bool) -> bool:
        """After the guards' round trip and a fresh cluster's bootstrap: the replacement
        nodes bootstrapped; True when it did (the nodes' facts are stale then)."""

    def run(self, handle: Handle, group: Group, task: Task, start: run.JobStart,
            watch: budget.Watch | None) -> run.Outcome:
        """run_task under its health watch (which carries ``watch``); a loss is an outcome."""


@dataclass(frozen=True)
class NodeContact:
    """What the launch's round trip to the node guards gave back: the job's id, the
    policy now on the nodes, and (when asked) each node's facts for run_task."""

    job_id: str
    policy: Policy
    facts: Mapping[int, NodeFacts] | None = None


@dataclass(frozen=True)
class Tried:
    """How one attempt ended, when it did not raise: the job's outcome, or the UserError
    that refused it before its job started (raised by the chain after its teardown);
    ``keep_up``: the cluster stays up whatever --down says (a refused launch on a cluster
    that was there; a job queued after this one)."""

    outcome: run.Outcome | None
    refused: UserError | None = None
    keep_up: bool = False
    interrupted: list[str] = field(default_factory=list)
    """What the provider said it took back (spot), in words."""


def attached_grace() -> tuple[float, float]:
    """Seconds the node guards leave an attached launch to end the job itself (pull outputs,
    tear down) after the job ended / the budget was reached, before acting on their own."""
    import os

    v = os.environ.get("CLOUDTRAIN_GUARD_ATTACHED_GRACE")
    return (float(v), float(v)) if v else (300.0, 60.0)


def attempt(env: Env, req: Launch, limit: budget.Budget | None,
            again: Replacing | None = None) -> Tried:
    """One attempt at ``req`` on its cluster (``limit``: the budget in force, watched here
    unless detached). ``again``: launch --recover's hooks."""
    task = req.task
    before = saved(env, req.name)
    with (again.opened() if again is not None
          else opened(env, task, req.name, planned=req.plan)) as (handle, group, fresh):
        contact = on_nodes(env, handle, group, req, prep=True,
                           supersedes=None if again is None else again.superseded)
        if fresh:
            bootstrap_or_roll_back(env, handle, group, task, req.name)
        replaced = again is not None and again.ready(handle, group, fresh)
        stale = fresh or replaced      # bootstrapped here: the facts asked before are old
        watch = None if limit is None or req.detach else budget.Watch(
            env.state, req.name, limit.max_cost_usd, env.ui)
        start = run.JobStart(contact.job_id, req.overrides, req.detach, req.now,
                             None if stale else contact.facts)
        try:   # launch --preflight, or the first multi-node launch: stopped when it fails
            proven = preflight.not_under_recovery(env, req) if again is not None else \
                preflight.before_job(env, handle, group, req, contact.job_id)
        except preflight.PreflightFailed as exc:   # the cluster stays up, --down or not
            return Tried(None, exc, rules_back(env, handle, group, before))
        with follower.Heartbeat(handle, group, contact.job_id, req.down_after and not req.detach):
            try:
                outcome = (again.run(handle, group, task, start, watch) if again is not None
                           else run.run_task(env, handle, group, task, start, watch))
            except UserError as exc:
                # Refused before its job started on a cluster that was there (--now, a change
                # under a busy cluster): its rules are taken back, and its --down tears
                # nothing down.
                return Tried(None, exc, not fresh and rules_back(env, handle, group, before))
            finally:
                preflight.record(env, contact.job_id, proven)
            keep_up = req.down_after and not req.detach and queued_after(
                env, handle, group, contact.job_id)
        spot = again is None and outcome.exit_code != 0 and handle.row.use_spot
    return Tried(outcome, keep_up=keep_up, interrupted=interruptions(handle, req.name)
                 if spot else [])


def on_nodes(env: Env, handle: Handle, group: Group, req: Launch, *,
             prep: bool = False, supersedes: str | None = None) -> NodeContact:
    """The launch's rules on the node guards (job-end stop for --down, the budget), composed
    with the cluster's (pipeline/rules.py), before the job starts: they hold when this CLI is
    gone. With ``prep``, the same round trip asks each node what run_task needs to know
    (bootstrapped? synced? set up?). ``supersedes``: the job a recovery stopped, whose rules
    this one takes over. Says the budget in force."""
    from cloudtrain.pipeline.remote_job import new_job_id

    job_id = new_job_id()
    job_end, over = (0.0, 0.0) if req.detach else attached_grace()
    own = None if req.budget is None else req.budget.max_cost_usd
    asked = rules.LaunchRules(
        job_id, own, "max_cost_usd" if own is not None and own == req.task.max_cost_usd
        else "--max-cost", req.no_budget, req.down_after, None if req.detach else job_end,
        supersedes)
    written = node_guard.update(
        env, handle, group, req.task, mode="install", budget_grace_s=over,
        then=prep_command(handle, req.task) if prep else None,
        **rules.compose(saved(env, handle.name), asked))
    pol = written.policy
    env.state.set_budget(handle.name, pol.max_cost_usd)
    env.ui.info(f"Budget in force on '{handle.name}': {rules.budget_words(pol.as_dict())}")
    return NodeContact(job_id, pol, prep_facts(written.session) if prep else None)


def rules_back(env: Env, handle: Handle, group: Group, before: Mapping[str, Any]) -> bool:
    """A refused launch's rules taken back: the budget and job-end stops as they were
    before it. Returns True (the cluster stays as it is: its --down does not apply)."""
    try:
        kept: dict[str, Any] = {k: before.get(k) for k in rules.COMPOSED}
        node_guard.update(env, handle, group, None, **kept)
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
    """A cluster this launch created is bootstrapped here, and the task's image pulled on it;
    when that fails or is interrupted, what was created is removed again (as 'up' does),
    before the error is reported."""
    env.ui.step("Bootstrapping")
    try:
        run_bootstrap(env, handle, group, task.bootstrap,
                      container=task.container is not None)
        if task.container is not None:    # a pull that fails rolls the new cluster back too
            pull.ensure_image(env, handle, group, task.container)
    except BaseException:
        with Shielded():
            if task.container is not None:    # and what the other nodes pulled goes with it
                pull.forget_images(env, handle, group)
            group.close()
            roll_back(env, handle.provider, name)
        raise


def interruptions(handle: Handle, name: str) -> list[str]:
    """What the provider says it took back (spot interruptions), in words; [] when it cannot
    tell."""
    from cloudtrain.provider.contract import ReportsInterruptions

    if not isinstance(handle.provider, ReportsInterruptions):
        return []
    try:
        return [str(x) for x in handle.provider.interruptions(name)]
    except CloudtrainError:
        return []
