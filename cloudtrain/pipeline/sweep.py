"""``cloudtrain sweep SWEEP.yaml`` from the laptop's side (docs/sweep.md): load the sweep file
(cloudtrain/sweepspec.py) and its task, refuse before anything is created when the trials
cannot fit the sweep's budget, bring the cluster up through the one launch chain
(pipeline/job.py ``up``), put the sweep's budget and its ``down:`` on the node guards (the
cluster's rules, pipeline/rules.py: they hold with the laptop closed), start the driver
(cloudtrain/node/sweep.py) on the head and record the sweep locally. Reading a running sweep
is pipeline/sweepread.py."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cloudtrain.errors import UserError
from cloudtrain.pipeline import sweepnode, sweepout, sweepscript
from cloudtrain.provider.contract import Plan
from cloudtrain.schema import NodeRow, SweepRow

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.remote import Group
    from cloudtrain.sweepspec import Sweep as SweepFile  # annotations only: no pydantic
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


@dataclass(frozen=True)
class Sweep:
    """One sweep asked for on the command line: its file, its task, where it runs."""

    path: Path
    spec: SweepFile
    task: Task
    name: str
    cluster: str


def load(path: str, cluster: str | None) -> Sweep:
    """The sweep file (exit 2 naming the field when it is wrong), its task (relative to the
    sweep file), and the cluster it runs on (-c, else the file's ``cluster:``, else the
    task's name)."""
    from cloudtrain.cluster import resolve_name
    from cloudtrain.names import check
    from cloudtrain.provider.options import load_checked
    from cloudtrain.sweepspec import load_sweep

    spec: SweepFile = load_sweep(Path(path))
    task_path = Path(path).resolve().parent / spec.task
    task = load_checked(str(task_path))
    if task.container is not None:   # trials run on the hosts: never silently outside the image
        from cloudtrain.errors import SpecError
        raise SpecError("is set, but a sweep's trials run on the nodes' hosts, not in a "
                        "container (not supported yet).", "Remove 'container:' from the task "
                        "for a sweep, or run each trial as a launch of the task (cloudtrain "
                        "launch TASK --env ...).", field="container", source=str(task_path))
    check_gpus(spec, task, path)
    name = check(Path(path).stem)
    return Sweep(Path(path), spec, task, name,
                 resolve_name(task, cluster or spec.cluster, str(task_path)))


def check_gpus(spec: SweepFile, task: Task, path: str) -> None:
    """``gpus_per_trial`` above a node's GPU slots: exit 2 naming the field (no trial could
    ever start)."""
    from cloudtrain.errors import SpecError

    have = slots_per_node(task)
    if spec.gpus_per_trial > have:
        raise SpecError(
            f"is {spec.gpus_per_trial}, but a node of the task's cluster has {have} GPU "
            "slot(s), so no trial could start.",
            "Lower gpus_per_trial, or pick nodes with more GPUs (resources.accelerators; on "
            "local nodes resources.local.gpus).", field="gpus_per_trial", source=path)


def trial_hours(spec: SweepFile, task: Task) -> float | None:
    """How long one trial may take, for the estimate: the sweep's ``trial_hours``, else the
    task's ``max_hours``."""
    own = spec.trial_hours
    return float(own) if own is not None else task.max_hours


def slots_per_node(task: Task) -> int:
    """The GPU slots of one node: the task's accelerators, or ``resources.local.gpus`` (the
    declared slots of a local node), else one."""
    res = task.resources
    if res.accelerators is not None:
        return res.accelerators.count
    local = getattr(res, "local", None)
    gpus = local.get("gpus") if isinstance(local, dict) else getattr(local, "gpus", None)
    return int(gpus) if isinstance(gpus, int) and gpus > 0 else 1


@dataclass(frozen=True)
class Estimate:
    """What the sweep may cost: ``waves`` rounds of ``parallel`` trials, each ``hours`` long,
    on the whole cluster at ``rate`` $/h."""

    trials: int
    parallel: int
    hours: float
    rate: float

    @property
    def waves(self) -> int:
        return math.ceil(self.trials / self.parallel)

    @property
    def usd(self) -> float:
        return self.waves * self.hours * self.rate

    def trials_within(self, usd: float) -> int:
        """The most trials this budget pays for."""
        per_wave = self.hours * self.rate
        return self.trials if per_wave <= 0 else int(usd // per_wave) * self.parallel


def estimate(spec: SweepFile, task: Task, plan: Plan) -> Estimate | None:
    """The sweep's estimate, or None when the price or the trial time is unknown."""
    hours = trial_hours(spec, task)
    if hours is None or plan.hourly_price_per_node is None:
        return None
    slots = plan.num_nodes * max(1, slots_per_node(task) // max(1, spec.gpus_per_trial))
    parallel = slots if spec.parallel == "auto" else max(1, min(int(spec.parallel), slots))
    return Estimate(spec.trials, parallel, hours, plan.hourly_price_per_node * plan.num_nodes)


def check_budget(sw: Sweep, plan: Plan, spent: float = 0.0) -> Estimate | None:
    """Refuse (exit 2, nothing created) when what the cluster has cost (``spent``: the budget
    on the guards is the cluster's) plus trials x trial time x price cannot fit the sweep's
    ``max_cost_usd``; say what would."""
    cap = sw.spec.max_cost_usd
    est = estimate(sw.spec, sw.task, plan)
    if cap is None:
        return est
    if est is None:
        raise UserError(
            f"The sweep has a budget of ${cap:.2f} (max_cost_usd), but its cost cannot be "
            "estimated: the price of the nodes or the time of one trial is unknown.",
            "Add 'trial_hours: H' to the sweep file (or max_hours to the task) and pick "
            "resources with a known price.")
    if spent + est.usd > cap + 1e-12:
        fit = est.trials_within(max(0.0, cap - spent))
        already = f" plus ${spent:.4f} the cluster has already cost" if spent > 0 else ""
        raise UserError(
            f"The sweep's estimate is ${est.usd:.4f}: {est.trials} trials, {est.parallel} at a "
            f"time, so {est.waves} round(s) of {est.hours:g} h on ${est.rate:.4f}/h{already}. "
            f"That is more than its budget of ${cap:.4f} (max_cost_usd), so nothing was "
            "created.",
            (f"{fit} trial(s) fit this budget (trials: {fit}); or raise" if fit else
             f"Not one round of {est.parallel} trial(s) fits this budget: raise") +
            f" max_cost_usd to ${spent + est.usd:.2f}, or shorten trial_hours.")
    return est


def find_record(env: Env, name: str) -> SweepRow:
    """The sweep this machine started under ``name`` (exit 2 when there is none)."""
    from cloudtrain.names import check

    row = env.state.get_sweep(check(name))
    if row is None:
        raise UserError(f"No sweep named '{name}' was started from this machine.",
                        "'cloudtrain sweep SWEEP.yaml' starts one; the name is the file's stem.")
    return row


def start(env: Env, sw: Sweep, plan: Plan, confirm: Callable[[Plan], None]) -> SweepRow:
    """Bring the cluster up (the launch chain's ``up``; ``confirm`` asks before a new one is
    paid for), record the sweep, put its rules on the node guards, start the driver on the
    head. The record comes before the driver: a CLI killed once the driver runs leaves a
    sweep that ``sweep status``/``results`` can read."""
    from cloudtrain.cluster import connect
    from cloudtrain.ledger import cluster_spend
    from cloudtrain.pipeline import job

    existing = env.state.get_cluster(sw.cluster) is not None
    check_budget(sw, plan, (cluster_spend(env.state, sw.cluster) or 0.0) if existing else 0.0)
    if not existing:
        confirm(plan)
    handle = job.up(env, sw.task, sw.cluster, planned=plan)    # it takes the cluster's lock
    group = connect(env, handle)
    try:
        return drive(env, sw, handle, group)
    finally:
        group.close()


def drive(env: Env, sw: Sweep, handle: Handle, group: Group, *, record: bool = True,
          driver: bool = True, grace: float | None = None) -> SweepRow:
    """On the cluster that is up: the workdir sent, the sweep recorded (``record``), its rules
    on the node guards (``grace``: an attached controller's), the driver started on the head
    (``driver``). ``sweep --recover``'s controller does it again after a replacement
    (pipeline/sweeprecover.py)."""
    sweepscript.prepare_nodes(env, handle, sw.task, sw.name)   # sync and setup: launch's
    rec = SweepRow(sw.name, sw.cluster, sw.spec.model_dump(mode="json"), time.time(),
                   handle.row.hourly_price, slots_per_node(sw.task))
    if record:
        env.state.add_sweep(rec)
        sweepout.record(env, sw.cluster, sw.name, sw.task)     # its trials' outputs come back
    sweepnode.put_rules(env, handle, group, sw.task, sweepnode.Rules(
        sweepnode.driver_job(sw.name), sw.spec.max_cost_usd, sw.spec.down, grace))
    if driver:
        got = sweepnode.start_driver(handle, group, sw.name, spec_json(sw, handle.nodes))
        env.ui.info(started_words(got))
    return rec


def started_words(got: sweepnode.Started) -> str:
    """What was started where, in one line."""
    if got.port is None:
        return f"Sweep driver on the head: pid {got.pid}."
    workers = ", ".join(f"node {r} pid {p}" for r, p in sorted(got.workers.items()))
    return (f"Sweep driver on the head: pid {got.pid}, its study served to the other nodes at "
            f"{got.host}:{got.port} (the head's internal address); workers: {workers}.")


def spec_json(sw: Sweep, nodes: list[NodeRow]) -> str:
    """The spec the driver is started with: the sweep file's fields, the trial's ``script``
    (pipeline/sweepscript.py), the task's ``stop_grace`` (a pruned trial's), the GPU
    ``slots`` of a node, the nodes' internal addresses (``nodes``, by rank: how results name
    them) and, on several nodes, ``host``: the head's internal address, where it serves the
    study to the other nodes' workers."""
    from cloudtrain.pipeline.sweepscript import trial_script

    doc = sw.spec.model_dump(mode="json")
    doc.update(name=sw.name, stop_grace=sw.task.stop_grace, slots=slots_per_node(sw.task),
               nodes=[n.internal_ip for n in nodes],
               script=trial_script(sw.task, nodes[0], sw.spec.gpus_per_trial))
    if len(nodes) > 1:
        doc["host"] = nodes[0].internal_ip
    if sw.task.checkpoints:     # the head keeps the study there (node/sweepkeep.py)
        doc["keep"] = {"url": str(sw.task.checkpoints), "env": dict(sw.task.envs)}
    return json.dumps(doc)
