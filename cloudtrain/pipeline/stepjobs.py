"""A scheduler's allocation (provider: slurm) from the CLI: the rules its guard enforces
(written to the shared filesystem at ``up`` and every launch), and ``logs``, ``cancel`` and
``queue`` of the jobs that run in it as steps (docs/slurm.md). The nodes are never SSHed to:
every file is read and every command run through the login node, by the provider's
``allocation_jobs`` (provisioners' slurm/detached.py)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from cloudtrain.context import Env
from cloudtrain.errors import UserError
from cloudtrain.pipeline import guard as node_guard
from cloudtrain.pipeline import rules
from cloudtrain.pipeline.lastseen import saved

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.pipeline.policy import Policy
    from cloudtrain.pipeline.request import Launch
    from cloudtrain.taskmodel import Task


class AllocationJobs(Protocol):
    """What the provider's ``allocation_jobs`` gives (slurm/detached.py AllocationJobs)."""

    allocation: Any

    def write_policy(self, policy: dict[str, object], attached: str | None = None) -> None: ...

    def submit(self, job_id: str, local: Path | None, filters: list[str], script: str,
               env: Mapping[str, str], gpus_per_job: int | None) -> bool: ...

    def files(self) -> Mapping[str, Any]: ...

    def read_logs(self, job_id: str, offsets: dict[int, int]) -> Any: ...

    def cancel(self, job_id: str) -> str | None: ...

    def steps(self) -> dict[str, str]: ...

    def guard_log(self) -> str: ...


@runtime_checkable
class HasAllocationJobs(Protocol):
    def allocation_jobs(self, cluster: str) -> AllocationJobs: ...


def scheduled(env: Env, name: str) -> bool:
    """Whether ``name`` is a cluster of a scheduler's allocation (its jobs are steps)."""
    from cloudtrain.provider.contract import Allocates

    row = env.state.get_cluster(name)
    return row is not None and row.provider in env.provider_names() \
        and issubclass(env.provider_class(row.provider), Allocates)


def jobs_of(env: Env, name: str) -> AllocationJobs:
    row = env.state.get_cluster(name)
    provider = env.provider(row.provider) if row is not None else None
    if not isinstance(provider, HasAllocationJobs):
        raise UserError(f"cluster '{name}' has no allocation of a scheduler.", "")
    return provider.allocation_jobs(name)


# --- the guard's rules ------------------------------------------------------------------------

def write_rules(env: Env, handle: Handle, task: Task | None, jobs: AllocationJobs,
                attached: str | None = None, **changes: Any) -> Policy:
    """The cluster's policy (pipeline/guard.py ``desired``: the task's idle stop, the rules
    composed across launches, the price) written where the allocation's guard reads it, and
    kept here; ``attached``: the attached job about to run, whose step the guard watches. The
    lifetime is Slurm's time limit, not the guard's."""
    # a stop on Slurm always ends the allocation (there is no stopped allocation to restart)
    pol = node_guard.desired(env, handle, task, **changes).changed(down=True)
    jobs.write_policy(dict(pol.as_dict(), max_hours=None, rank=0,
                           self_stop="scancel $SLURM_JOB_ID"), attached)
    node_guard.save(env, handle.name, pol)
    env.state.set_budget(handle.name, pol.max_cost_usd)
    return pol


def launch_rules(env: Env, handle: Handle, req: Launch, job_id: str,
                 jobs: AllocationJobs) -> None:
    """A launch's rules (its --down job end, its budget) composed with the cluster's."""
    own = None if req.budget is None else req.budget.max_cost_usd
    asked = rules.LaunchRules(
        job_id, own, "max_cost_usd" if own is not None and own == req.task.max_cost_usd
        else "--max-cost", req.no_budget, req.down_after, None if req.detach else 0.0)
    pol = write_rules(env, handle, req.task, jobs, None if req.detach else job_id,
                      **rules.compose(saved(env, handle.name), asked))
    env.ui.info(f"Budget in force on '{handle.name}': {rules.budget_words(pol.as_dict())}")


# --- logs ---------------------------------------------------------------------------------------

def latest(env: Env, name: str, job_id: str | None) -> Any:
    """The launch row of ``job_id`` (default: the cluster's latest)."""
    launches = env.state.launches(name)
    if not launches:
        raise UserError(f"no job was launched on '{name}' from here.",
                        f"Launch one: cloudtrain launch TASK -c {name}")
    if job_id is None:
        return launches[-1]
    found = [r for r in launches if r.job_id == job_id]
    if not found:
        raise UserError(f"'{name}' has no job {job_id}.",
                        "Its jobs: " + ", ".join(r.job_id for r in launches[-5:])
                        + f" (cloudtrain queue {name}).")
    return found[0]


def show_logs(env: Env, name: str, job_id: str | None, follow: bool,
              node: int | None) -> None:
    """A job's lines, each with its node: a detached job's from the shared filesystem (with
    --follow, until it ends), an attached one's as its launch kept them here."""
    row = latest(env, name, job_id)
    if not row.detached:
        folder = env.logs_dir(name) / row.job_id
        files = sorted(folder.glob("node-*.log")) if folder.is_dir() else []
        for f in files:
            rank = int(f.stem.split("-")[1])
            if node is None or rank == node:
                for line in f.read_text(errors="replace").splitlines():
                    env.ui.node_line(rank, line)
        if not files:
            env.ui.info(f"Job {row.job_id} kept no lines here.")
        return
    jobs = jobs_of(env, name)
    nodes = len(env.state.get_cluster(name).nodes)   # type: ignore[union-attr]
    offsets = {n: 0 for n in range(nodes) if node is None or n == node}
    partial: dict[int, bytes] = {n: b"" for n in offsets}
    while True:
        got = jobs.read_logs(row.job_id, offsets)
        for n, chunk in sorted(got.chunks.items()):
            offsets[n] = got.sizes[n]
            *whole, partial[n] = (partial[n] + chunk).split(b"\n")
            for line in whole:
                env.ui.node_line(n, line.decode(errors="replace"))
        if got.done or not follow:
            break
        time.sleep(1.0)
    for n, rest in sorted(partial.items()):
        if rest:
            env.ui.node_line(n, rest.decode(errors="replace"))
    sys.stdout.flush()


# --- queue and cancel ---------------------------------------------------------------------------

@dataclass(frozen=True)
class JobView:
    """One job of the cluster as ``queue`` shows it: ``state`` is running (``step``: its Slurm
    step), waiting for resources, submitted (the guard has not taken it yet), succeeded,
    failed, cancelled, or ended (with an allocation that is gone)."""

    job_id: str
    task: str | None
    detached: bool
    state: str
    step: str | None
    exit_code: int | None
    node_codes: Mapping[int, int]
    started_at: float


def _state(row: Any, f: Any, step: str | None, alloc_runs: bool) -> tuple[str, int | None]:
    if step is not None:
        return "running", None
    if not row.detached and row.status != "RUNNING":   # as the attached launch recorded it
        return row.status.lower(), row.exit_code
    if f is not None and f.cancelled:
        return "cancelled", f.rc
    if f is not None and f.ended:
        failed = f.rc not in (0, None) or any(c != 0 for c in f.node_codes.values())
        return ("failed" if failed else "succeeded"), f.rc
    if row.status != "RUNNING":                      # what the attached launch recorded
        return row.status.lower(), row.exit_code
    if not alloc_runs or (not row.detached and f is None):
        return "ended", None
    if row.detached and (f is None or not f.started):
        return "submitted", None
    return "waiting for resources", None


def views(env: Env, name: str) -> list[JobView]:
    """The cluster's jobs, oldest first, as Slurm and the shared filesystem say now; a
    detached job found ended is recorded so here."""
    jobs = jobs_of(env, name)
    files, steps = jobs.files(), jobs.steps()
    out = []
    for row in env.state.launches(name):
        f = files.get(row.job_id)
        state, code = _state(row, f, steps.get(row.job_id), jobs.allocation is not None)
        if row.status == "RUNNING" and state in ("succeeded", "failed", "cancelled", "ended"):
            codes = dict(f.node_codes) if f is not None else {}
            bad = sorted(n for n, c in codes.items() if c != 0)
            env.state.finish_launch(row.job_id, state.upper() if state != "ended" else "LOST",
                                    code, bad[0] if bad else None)
        out.append(JobView(row.job_id, row.task_name, row.detached, state,
                           steps.get(row.job_id), code,
                           dict(f.node_codes) if f is not None else {}, row.started_at))
    return out


def cancel(env: Env, name: str, job_id: str | None) -> None:
    """``cancel NAME JOB`` (None: every job that runs or waits): scancel of its step, or
    never started; the allocation and the other jobs keep running."""
    found = views(env, name)
    live = [v for v in found if v.state in ("running", "waiting for resources", "submitted")]
    if job_id is not None:
        asked = [v for v in found if v.job_id == job_id]
        if not asked:
            raise UserError(f"'{name}' has no job {job_id}.", f"List them: cloudtrain queue {name}")
        if asked[0] not in live:
            raise UserError(f"job {job_id} has already ended ({asked[0].state}).",
                            f"List the jobs: cloudtrain queue {name}")
        live = asked
    jobs = jobs_of(env, name)
    for v in live:
        step = jobs.cancel(v.job_id)
        env.state.finish_launch(v.job_id, "CANCELLED", None, None, "cloudtrain cancel")
        env.ui.ok(f"Job {v.job_id} cancelled" + (f" (Slurm step {step} scancel'ed)" if step
                                                  else " before its step started")
                  + "; the allocation and its other jobs keep running.")
    if not live:
        env.ui.info(f"No job runs or waits on '{name}'.")


def rows(found: list[JobView]) -> list[dict[str, Any]]:
    return [{"id": v.job_id, "state": v.state, "step": v.step, "exit_code": v.exit_code,
             "node_codes": {str(k): c for k, c in v.node_codes.items()},
             "detached": v.detached, "task": v.task,
             "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.started_at))}
            for v in found]


def show_queue(env: Env, name: str, as_json: bool) -> None:
    """``queue NAME``: the cluster's jobs and their Slurm step state (a table, or JSON)."""
    import json

    found = views(env, name)
    print(json.dumps(rows(found), indent=2) if as_json else
          "\n".join(table(found)) if found else f"No jobs on '{name}'.", flush=True)


def check_budget(env: Env, name: str, planned: Any, limit: Any) -> None:
    """Refuse the launch (exit 2) when what the cluster has cost plus its price for the
    budget's hours exceeds the budget; else say how much of it the estimate takes."""
    from cloudtrain import budget
    from cloudtrain.ledger import cluster_spend

    row = env.state.get_cluster(name)
    estimate = budget.check_before_launch(
        limit, cluster=name,
        price_per_node=row.hourly_price if row else planned.hourly_price_per_node,
        num_nodes=row.num_nodes if row else planned.num_nodes,
        spent=cluster_spend(env.state, name) if row else 0.0)
    env.ui.info(f"Estimate for {limit.hours:g} h: ${estimate:.4f} of the "
                f"${limit.max_cost_usd:.4f} budget.")


def table(found: list[JobView]) -> list[str]:
    head = ("JOB", "STATE", "STEP", "EXIT", "NODES' EXIT", "LAUNCHED", "TASK")
    cells = [head] + [(r["id"], r["state"], r["step"] or "-",
                       "-" if r["exit_code"] is None else str(r["exit_code"]),
                       ",".join(f"{k}:{c}" for k, c in sorted(r["node_codes"].items())) or "-",
                       r["started"] + ("" if r["detached"] else " (attached)"),
                       r["task"] or "-") for r in rows(found)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


class LineKeeper:
    """An attached job's lines, kept here by node (``logs`` replays them)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[int, Any] = {}

    def add(self, rank: int, text: str) -> None:
        f = self.files.get(rank)
        if f is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                f = self.files[rank] = open(self.folder / f"node-{rank}.log", "a")
            except OSError:
                return
        f.write(text + "\n")
        f.flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def guard_up(env: Env, handle: Handle, task: Task) -> None:
    """``up``: the task's rules (its idle stop, the price for a budget) to the guard."""
    provider = handle.provider
    if isinstance(provider, HasAllocationJobs):
        write_rules(env, handle, task, provider.allocation_jobs(handle.name))


def show_guard_log(env: Env, name: str) -> None:
    """``logs --guard``: the running allocation's guard log, read through the login node."""
    text = jobs_of(env, name).guard_log()
    for line in text.splitlines():
        env.ui.node_line(0, line)
    if not text:
        env.ui.info(f"'{name}' has no running allocation with a guard log.")
