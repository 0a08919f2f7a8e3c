"""Run a task on a cluster: sync, setup (once per content hash), run on every node at once,
stream logs, stop every node when one fails or on Ctrl-C, pull outputs back; ``exec``'s
command on some nodes. The fan-out itself is :mod:`cloudtrain.pipeline.remote_job`."""

from __future__ import annotations

import hashlib
import shlex
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from cloudtrain import paths
from cloudtrain.cluster import Handle, cluster_uid
from cloudtrain.containers import runtime, wrap
from cloudtrain.context import Env
from cloudtrain.errors import Interrupted, JobFailed, RemoteError, UserError
from cloudtrain.pipeline import outputs, queue, ranklog, sent, skyenv, storage, sync
from cloudtrain.pipeline.bodies import run_body, train_body
from cloudtrain.provider.fabric import job_vars
from cloudtrain.pipeline.bootstrap import provider_node_env, run_bootstrap
from cloudtrain.pipeline.prep import NodeFacts, prep_command, prep_facts
from cloudtrain.pipeline.remote_job import (JobParts, LogSink, RemoteJob, job_dir, new_job_id,
                                            read_worker_failures)
from cloudtrain.remote import Group, bash
from cloudtrain.connection import Result
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.budget import JobWatch
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


@dataclass
class Outcome:
    job_id: str
    exit_code: int
    failed_node: int | None = None
    failed_rank: int | None = None
    node_codes: dict[int, int | None] = field(default_factory=dict)
    outputs: list[Path] = field(default_factory=list)
    detached: bool = False
    queued: bool = False
    """A detached job that waits its turn in the cluster's queue (the nodes start it)."""
    failure: ranklog.Failed | None = None
    """A failed train job's first failing worker, with its last lines (the report)."""
    logs: Path | None = None
    """The job's local log folder."""


# --- environment and scripts -----------------------------------------------------------------

def job_env(env: Env, handle: Handle, node: NodeRow, envs: dict[str, str], job_id: str,
            overrides: dict[str, str], task: Task | None = None) -> dict[str, str]:
    nodes = handle.nodes
    gpus = min((n.gpus or 0) for n in nodes) if nodes else 0
    head = nodes[0]
    out = {
        "CLOUDTRAIN_CLUSTER": handle.name,
        "CLOUDTRAIN_NODE_RANK": str(node.rank),
        "CLOUDTRAIN_NUM_NODES": str(len(nodes)),
        "CLOUDTRAIN_NODE_IPS": "\n".join(n.internal_ip for n in nodes),
        "CLOUDTRAIN_HEAD_IP": head.internal_ip,
        "CLOUDTRAIN_GPUS_PER_NODE": str(gpus),
        "CLOUDTRAIN_WORKDIR": sync.workdir_on(node),
        "MASTER_ADDR": head.internal_ip,
        "MASTER_PORT": str(handle.row.master_port),
        "PYTHONUNBUFFERED": "1",
    }
    out.update(skyenv.aliases(out, job_id))   # SKYPILOT_NODE_RANK ... beside ours
    out.update(job_vars(provider_node_env(handle)))   # the fast network's (docs/network.md)
    if node.iface:
        out["GLOO_SOCKET_IFNAME"] = node.iface
        out["NCCL_SOCKET_IFNAME"] = node.iface
    out.update(envs)
    out.update(overrides)
    out.update(storage.job_env(task, node) if task is not None else {})
    # The markers every process of the job inherits; never overridable (stopping relies on them).
    out["CLOUDTRAIN_JOB_ID"] = job_id
    out["CLOUDTRAIN_JOB_DIR"] = job_dir(node, job_id)
    out["CLOUDTRAIN_CLUSTER_ID"] = cluster_uid(env, handle.name)
    return out


def script(node: NodeRow, env_vars: dict[str, str], body: str) -> str:
    lines = ["#!/usr/bin/env bash", "# written by cloudtrain"]
    for k, v in env_vars.items():
        lines.append(f"export {k}={shlex.quote(v)}")
    if node.python_bin:
        lines.append(f"export PATH={shlex.quote(node.python_bin)}:\"$PATH\"")
    wd = shlex.quote(sync.workdir_on(node))
    lines.append(f"mkdir -p {wd} && cd {wd} || exit 1")
    lines.append(body)
    return "\n".join(lines) + "\n"


def r_script(node: NodeRow, env_vars: dict[str, str], boxes: dict[int, str], body: str) -> str:
    return script(node, env_vars, wrap.maybe(node, boxes.get(node.rank), env_vars, body))


def _mark(group: Group, ranks: list[int], filename: str, value: str) -> None:
    if ranks:
        group.run(lambda n: bash(f"echo {shlex.quote(value)} > {shlex.quote(n.root_dir)}/{filename}"),
                  ranks=ranks).raise_on_failure(f"Recording {filename}")


def sync_plan(task: Task) -> sync.SyncPlan:
    wd = task.workdir_path()
    exclude: list[str] = []
    if wd is not None:
        # Never sent: the outputs folder, and cloudtrain's own home (its state, logs and the
        # local nodes' roots) when it lies inside the workdir.
        for inner in (task.outputs_path(), paths.home().resolve()):
            try:
                exclude.append(inner.relative_to(wd).as_posix())
            except ValueError:
                pass
    mounts = tuple(sync.Mount((task.base_dir / local).resolve(), remote)
                   for remote, local in task.local_mounts().items())
    # Outputs and mount targets inside the workdir survive the workdir sync's --delete.
    inside = tuple(m.remote for m in mounts if not m.remote.startswith(("/", "~")))
    inside += tuple(t for t in task.bucket_mounts() if not t.startswith(("/", "~")))
    return sync.SyncPlan(workdir=wd, mounts=mounts, protect=tuple(task.outputs) + inside,
                         exclude=tuple(exclude))


@dataclass(frozen=True)
class JobStart:
    """How ``run_task`` starts the job: its id, ``--env``, detached or followed, ``--now``,
    and the nodes' facts when the caller already asked (prep_command, folded into its own
    round trip; None: run_task asks)."""

    job_id: str
    overrides: Mapping[str, str] = field(default_factory=dict)
    detach: bool = False
    now: bool = False
    prep: Mapping[int, NodeFacts] | None = None


@dataclass(frozen=True)
class Running:
    """What every step of one run_task shares."""

    env: Env
    handle: Handle
    group: Group
    task: Task
    start: JobStart
    watch: JobWatch | None
    boxes: dict[int, str] = field(default_factory=dict)   # rank -> its container (runtime.py)

    @property
    def job_id(self) -> str:
        return self.start.job_id

    def env_of(self, node: NodeRow, job_id: str, task: Task | None = None) -> dict[str, str]:
        return job_env(self.env, self.handle, node, self.task.envs, job_id,
                       dict(self.start.overrides), task)



def run_task(env: Env, handle: Handle, group: Group, task: Task, start: JobStart,
             watch: JobWatch | None = None) -> Outcome:
    """Sync, setup, run the job on every node, follow it, pull its outputs. ``watch``: what
    runs beside the job from here until it ends (foreground only): the budget watch, or
    ``--recover``'s health watch that carries it. When the budget is reached, the job is
    stopped on every node, outputs are pulled back, the launch is recorded as BUDGET and
    :class:`~cloudtrain.budget.BudgetExceeded` is raised (the caller tears the cluster down)."""
    r = Running(env, handle, group, task, start, watch)
    if watch is None:
        return _run_task(r)
    if start.detach:
        raise UserError("A budget cannot be watched on a detached launch.",
                        "Run it in the foreground, or launch with --no-budget.")
    watch.start()
    try:
        return _run_task(r)
    finally:
        watch.stop()


def _watched(job: RemoteJob, watch: JobWatch | None, detach: bool = False) -> dict[int, Result]:
    if watch is None:
        return job.run(detach=detach)
    watch.attach(job.stop_for_budget)
    try:
        return job.run(detach=detach)
    finally:
        watch.detach()


def _budget_spent(r: Running, job_id: str | None) -> None:
    """Between steps: raise once the watch has found the budget spent."""
    if r.watch is None or not r.watch.exceeded.is_set():
        return
    err = r.watch.error()
    if job_id is not None:
        r.env.state.finish_launch(job_id, "BUDGET", err.exit_code, None, err.reason)
    raise err


def prepare(env: Env, handle: Handle, group: Group, task: Task, job_id: str) -> None:
    """What a launch does before its job, without a job: sync, bucket file_mounts, setup
    (once per content hash, per node). ``sweep`` runs it before its trials; the setup's
    logs are those of ``job_id``."""
    r = Running(env, handle, group, task, JobStart(job_id), None)
    prep, setup_hash = _ready(r)
    if task.setup:
        _set_up(r, prep, setup_hash, env.logs_dir(handle.name) / job_id)


def _ready(r: Running) -> tuple[Mapping[int, NodeFacts], str]:
    """0.-1b. the nodes prepared and synced, their bucket file_mounts fetched. Returns the
    nodes' facts and the setup's hash."""
    plan = sync_plan(r.task)
    prep, fp = _prepared(r, plan)
    setup_hash = _synced(r, plan, prep, fp)
    # 1b. bucket file_mounts: every node fetches them itself, before setup
    storage.check_rclone(r.handle, r.task)
    storage.fetch_mounts(r.env, r.handle, r.group, r.task, {
        n.rank: r.env_of(n, r.job_id + "-fetch") for n in r.handle.nodes})
    # 1c. the task's container on every node (reused as it runs on a warm launch)
    boxes = runtime.ready(r.env, r.handle, r.group, r.task, prep)
    if boxes is not None:   # a container started now has none of an older one's setup
        r.boxes.update(boxes.names)
        prep = {k: replace(f, setup_hash="") if k in boxes.started else f for k, f in prep.items()}
    _budget_spent(r, None)
    return prep, setup_hash


def _run_task(r: Running) -> Outcome:
    if (zero := skyenv.zero_gpu_warning(r.task.run, (n.gpus for n in r.handle.nodes))):
        r.env.ui.warn(zero)
    prep, setup_hash = _ready(r)
    logs = r.env.logs_dir(r.handle.name) / r.job_id
    r.env.state.add_launch(r.handle.name, r.job_id, r.task.name, r.start.detach, r.task.container)
    r.env.state.set_job_envs(r.handle.name, {**r.task.envs, **r.start.overrides})   # for exec
    if r.task.setup:
        _set_up(r, prep, setup_hash, logs)
    job, res, turn, sink = _started(r, logs)
    if r.start.detach:
        return _detached(r, job, res, turn)
    return _ended(r, job, res, sink)


def _prepared(r: Running, plan: sync.SyncPlan
              ) -> tuple[Mapping[int, NodeFacts], Future[str] | None]:
    """0. What the nodes have (asked here unless the caller did), bootstrapped where they
    are not; the sync's fingerprint, taken while the nodes answer (None: take it again,
    after a bootstrap: edits made during it count)."""
    # The fingerprint (a local rsync listing, ~50 ms even for a small tree) is taken while the
    # nodes answer the prep round trip; again after a bootstrap (edits made during it count).
    fp_pool = ThreadPoolExecutor(max_workers=1)
    fp_future: Future[str] | None = fp_pool.submit(plan.fingerprint)
    fp_pool.shutdown(wait=False)
    prep = r.start.prep
    if prep is None:
        prep = prep_facts(r.group.run(prep_command(r.handle, r.task)))
    if r.start.now:
        # launch --now on a busy cluster: exit 2, unless its gpus_per_job slots are free
        queue.refuse_if_busy(r.handle, r.group, r.task.resources.gpus_per_job)
    if not all(f.bootstrapped and n.python_bin for n, f in zip(r.handle.nodes, prep.values())):
        r.env.ui.step("Bootstrapping")
        run_bootstrap(r.env, r.handle, r.group, r.task.bootstrap,
                      container=r.task.container is not None)
        fp_future = None
    _budget_spent(r, None)
    if r.task.train is not None and r.task.container is None:   # else: the image's PyTorch
        _check_torch(r.handle.nodes)
    return prep, fp_future


def _check_torch(nodes: list[NodeRow]) -> None:
    missing = [n.rank for n in nodes if (n.python_bin is None)]
    no_torch = [n.rank for n in nodes
                if n.python_bin is not None and n.bootstrap.get("torch", "missing") == "missing"]
    if missing or no_torch:
        raise UserError(
            f"'train:' needs PyTorch on every node; node(s) {missing + no_torch} have none.",
            "Let bootstrap install it (cloudtrain up), or name a Python environment that has "
            "it (resources.local.python on the local provider).")


def _synced(r: Running, plan: sync.SyncPlan, prep: Mapping[int, NodeFacts],
            fp_future: Future[str] | None) -> str:
    """1. sync, skipped where the node already has this exact content. Returns the setup's
    hash (setup, content, envs)."""
    nodes, task = r.handle.nodes, r.task
    t0 = time.monotonic()
    fp = fp_future.result() if fp_future is not None else plan.fingerprint()
    setup_hash = hashlib.sha256(f"{task.setup or ''}\0{fp}\0{sorted(task.envs.items())}".encode()
                                ).hexdigest()[:32]
    stale = [n for n in nodes if prep[n.rank].sync_fp != fp]
    changes = [what for what, yes in (
        ("the workdir/file_mounts", stale and (plan.workdir is not None or plan.mounts)),
        ("the setup", task.setup and any(prep[n.rank].setup_hash != setup_hash for n in nodes)))
        if yes]
    if changes:   # never under a job that runs or waits: it would see them mid-run
        queue.refuse_changes_while_busy(r.handle, r.group, " and ".join(changes))
    if stale and (plan.workdir is not None or plan.mounts):
        r.env.ui.step(f"Syncing {plan.workdir or 'file mounts'} to {len(stale)} node(s)")
        errors = sent.push_all(r.env, r.handle, plan, stale,
                               {n.rank: prep[n.rank].sync_fp for n in stale}, fp)
        bad = {rank: e for rank, e in errors.items() if e is not None}
        if bad:
            raise RemoteError("Sync failed: " + "; ".join(f"node {k}: {e}" for k, e in bad.items()),
                              "Check the nodes with 'cloudtrain status' and run launch again.")
        r.env.ui.ok(f"Synced in {time.monotonic() - t0:.2f}s")
    _mark(r.group, [n.rank for n in stale], ".sync-fp", fp)
    _budget_spent(r, None)
    return setup_hash


def _set_up(r: Running, prep: Mapping[int, NodeFacts], setup_hash: str, logs: Path) -> None:
    """2. setup, once per (setup, workdir content) per node."""
    env, handle, job_id = r.env, r.handle, r.job_id
    todo = [n.rank for n in handle.nodes if prep[n.rank].setup_hash != setup_hash]
    if not todo:
        env.ui.info("Setup unchanged since the last run on every node: skipped")
        return
    env.ui.step(f"Running setup on {len(todo)} node(s)")
    sink = LogSink(env, logs, ".setup", echo=True)
    scripts = {n.rank: r_script(n, r.env_of(n, job_id + "-setup"), r.boxes, str(r.task.setup))
               for n in handle.nodes}
    job = RemoteJob(env, handle, r.group, JobParts(job_id + "-setup", scripts, sink, todo,
                                                   grace=r.task.stop_grace))
    try:
        res = _watched(job, r.watch)
    except Interrupted:
        env.state.finish_launch(job_id, "INTERRUPTED", 130, None)
        raise
    finally:
        sink.close()
    _budget_spent(r, job_id)
    _raise_if_lost(env, job, job_id)
    first = job.first_failure()
    if first is not None:
        rank, code = first
        env.state.finish_launch(job_id, "FAILED", code or 1, rank)
        raise JobFailed(code or 1, rank, f"setup failed on node {rank} (exit code {code}).",
                        f"See the output above, or 'cloudtrain logs {handle.name} --node {rank}'.")
    _mark(r.group, [k for k in todo if res[k].ok], ".setup-hash", setup_hash)


def _started(r: Running, logs: Path
             ) -> tuple[RemoteJob, dict[int, Result], queue.Turn, ranklog.RankSink | None]:
    """3. the job on every node at once, through the cluster's queue; followed unless
    detached. A budget reached meanwhile is raised (outputs pulled first)."""
    env, handle, task, job_id = r.env, r.handle, r.task, r.job_id
    nodes = handle.nodes
    envs = {n.rank: r.env_of(n, job_id, task) for n in nodes}
    if task.train is not None:
        bodies = {n.rank: train_body(handle, n, task, job_id, r.boxes.get(n.rank), envs[n.rank])
                  for n in nodes}
    else:
        bodies = {n.rank: run_body(task, n, r.boxes.get(n.rank), envs[n.rank]) for n in nodes}
    scripts = {n.rank: script(n, envs[n.rank], bodies[n.rank]) for n in nodes}
    plain = LogSink(env, logs, "", echo=True)
    sink: LogSink | ranklog.RankSink = plain
    if task.train is not None:   # each rank's lines known, the terminal held back a moment
        sink = ranklog.RankSink(plain, verbose=env.ui.verbose,
                                watch_markers=task.train.max_restarts == 0)
    with open(logs / "job.txt", "w", opener=paths.private_opener) as f:
        f.write(f"job_id={job_id}\ncluster={handle.name}\nnodes={len(nodes)}\n")
    env.ui.step(f"Running job {job_id} on {len(nodes)} node(s)")
    outputs.record(env, handle.name, job_id, task)
    turn = queue.Turn(env, handle, r.group, job_id, task.name or "-", task.resources.gpus_per_job)
    job = RemoteJob(env, handle, r.group, JobParts(
        job_id, scripts, sink, [n.rank for n in nodes], grace=task.stop_grace, turn=turn,
        on_failure=sink.fail if isinstance(sink, ranklog.RankSink) else None))
    try:
        res = _watched(job, r.watch, detach=r.start.detach)
    except Interrupted:
        env.state.finish_launch(job_id, "INTERRUPTED", 130, None)
        # What the job wrote when it was stopped (a checkpoint on SIGTERM) comes back first;
        # a second signal gives up on it.
        if task.outputs:
            try:
                pull_outputs(env, handle, task, job_id)
            except KeyboardInterrupt:
                env.ui.warn("Interrupted again: outputs not pulled back.")
        raise
    finally:
        sink.close()
    if r.watch is not None and r.watch.exceeded.is_set():
        # Stopped for the budget: what the job wrote (a checkpoint on SIGTERM) comes back
        # before the caller tears the cluster down.
        if task.outputs:
            pull_outputs(env, handle, task, job_id)
        _budget_spent(r, job_id)
    return job, res, turn, sink if isinstance(sink, ranklog.RankSink) else None


def _detached(r: Running, job: RemoteJob, res: dict[int, Result], turn: queue.Turn) -> Outcome:
    """A detached job: started (or queued) on every node, or stopped everywhere."""
    not_started = [x for x in res.values() if not x.ok]
    if not_started:
        job.stop_everywhere("The job did not start on every node: stopping it")
        r.env.state.finish_launch(r.job_id, "FAILED", 1, not_started[0].rank)
        raise RemoteError(f"the job did not start on node {not_started[0].rank}: "
                          f"{not_started[0].error or not_started[0].stdout.strip()}",
                          "Check the node with 'cloudtrain status'.")
    if r.task.outputs:
        r.env.ui.info(f"Its outputs ({', '.join(r.task.outputs)}) stay on the nodes: 'cloudtrain "
                      f"outputs {r.handle.name}' pulls them ('down' does too, first).")
    return Outcome(r.job_id, 0, detached=True, queued=turn.queued)


def _ended(r: Running, job: RemoteJob, res: dict[int, Result],
           sink: ranklog.RankSink | None) -> Outcome:
    """A followed job has ended: its outcome (the first failing node, and worker, with its
    last lines), 4. its outputs pulled back, its launch row closed."""
    env, handle, task, job_id = r.env, r.handle, r.task, r.job_id
    _raise_if_lost(env, job, job_id)
    outcome = Outcome(job_id, 0, node_codes={n.rank: res[n.rank].exit_code for n in handle.nodes},
                      logs=env.logs_dir(handle.name) / job_id)
    first = job.first_failure()
    if first is not None:
        rank, code = first
        outcome.exit_code, outcome.failed_node = (code if code else 1), rank
        local = None
        if task.train is not None:
            worker = read_worker_failures(r.group, handle, job_id)
            if worker is not None:
                outcome.failed_node, outcome.failed_rank = worker.node, worker.rank
                outcome.exit_code, local = worker.code or 1, worker.local_rank
        if sink is not None:
            f = outcome.failure = sink.failure(outcome.failed_node, outcome.failed_rank,
                                               outcome.exit_code, local)
            # one failure, one code: the report's is the command's
            outcome.failed_node, outcome.failed_rank, outcome.exit_code = f.node, f.rank, f.code
    # 4. outputs
    if task.outputs:
        outcome.outputs = pull_outputs(env, handle, task, job_id)
    status = "SUCCEEDED" if outcome.exit_code == 0 else "FAILED"
    env.state.finish_launch(job_id, status, outcome.exit_code, outcome.failed_node)
    return outcome

def _raise_if_lost(env: Env, job: RemoteJob, job_id: str) -> None:
    """A node lost mid-run is reported as a lost connection to it (the job was already
    stopped on the other nodes), not as an exit code it never had."""
    lost = job.lost()
    if lost is not None:
        env.state.finish_launch(job_id, "FAILED", 1, lost.rank, lost.message)
        raise lost


def pull_outputs(env: Env, handle: Handle, task: Task, job_id: str) -> list[Path]:
    """The job's outputs back here, marked pulled (:mod:`cloudtrain.pipeline.outputs`)."""
    return outputs.pull_ended(env, handle, job_id, task)


def run_command(env: Env, handle: Handle, group: Group, command: str,
                ranks: list[int]) -> tuple[int, int | None]:
    """``cloudtrain exec``: a command on some nodes with the job environment, stopped on every
    node by Ctrl-C, in one session per node that also renews the node guard's lease (and
    restarts a guard that is gone). Returns (exit code, first failing node)."""
    from cloudtrain.pipeline import guard as node_guard
    from cloudtrain.pipeline import lastseen

    job_id = "exec-" + new_job_id()
    if (zero := skyenv.zero_gpu_warning(command, (n.gpus for n in handle.nodes), "the command")):
        env.ui.warn(zero)
    envs = env.state.job_envs(handle.name)   # the last launch's task envs and --env
    boxes = runtime.recorded(env, handle.name)   # the last launch's containers: exec runs in them
    scripts = {n.rank: r_script(n, job_env(env, handle, n, envs, job_id, {}), boxes, command)
               for n in handle.nodes}
    sink = LogSink(env, env.logs_dir(handle.name) / job_id, "", echo=True, raw=len(ranks) == 1)
    others = [n.rank for n in handle.nodes if n.rank not in ranks]
    # exec --node: the other nodes' guards hear from the CLI too, meanwhile
    beside = threading.Thread(target=node_guard.touch, args=(env, handle, group),
                              kwargs={"ranks": others}, daemon=True)
    if others:
        beside.start()
    touch, src = node_guard.command(env, handle, "touch", None), node_guard.guard_source()
    job = RemoteJob(env, handle, group, JobParts(job_id, scripts, sink, ranks,
                                                 stop_on_failure=False,
                                                 before=lambda n: (touch(n), src)))
    try:
        res = job.run()
    finally:
        sink.close()
        if others:
            beside.join(timeout=60)
        lastseen.contacted(env, handle.name)   # the lease was renewed; the command ran till now
    first = job.first_failure()
    if first is None:
        return 0, None
    rank, code = first
    if code is None:
        raise RemoteError(f"node {rank}: {res[rank].error}", "Check it with 'cloudtrain status'.")
    return code, rank
