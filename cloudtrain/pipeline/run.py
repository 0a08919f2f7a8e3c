"""Run a task on a cluster: sync, setup (once per content hash), run on every node at once,
stream logs, stop every node when one fails or on Ctrl-C, pull outputs back; ``exec``'s
command on some nodes. The fan-out itself is :mod:`cloudtrain.pipeline.remote_job`."""

from __future__ import annotations

import hashlib
import posixpath
import shlex
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Callable

from cloudtrain import paths
from cloudtrain.cluster import Handle, cluster_uid
from cloudtrain.context import Env
from cloudtrain.errors import Interrupted, JobFailed, RemoteError, UserError
from cloudtrain.pipeline import bootstrap, outputs, queue, sent, storage, sync, torchrun
from cloudtrain.pipeline.bootstrap import bootstrap_env, run_bootstrap
from cloudtrain.pipeline.remote_job import (LogSink, RemoteJob, job_dir, new_job_id,
                                            read_worker_failures)
from cloudtrain.remote import Group, GroupResult, Result, bash
from cloudtrain.state import NodeRow

if TYPE_CHECKING:
    from cloudtrain.spec import Task   # annotations only: no pydantic at import
    from cloudtrain.budget import Watch


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


def train_body(handle: Handle, node: NodeRow, task: Task, job_id: str) -> str:
    assert task.train is not None
    head = handle.nodes[0]
    gpus = min((n.gpus or 0) for n in handle.nodes)
    info = torchrun.NodeInfo(rank=node.rank, num_nodes=len(handle.nodes), node_ip=node.internal_ip,
                             head_ip=head.internal_ip, master_port=handle.row.master_port, gpus=gpus)
    wrapper = str(PurePosixPath(bootstrap.script_dir(node)) / "ctworker.sh")
    if not wrapper.startswith("/"):   # a root under the login's $HOME: the job runs in the workdir
        wrapper = posixpath.relpath(wrapper, sync.workdir_on(node))
    cmd = torchrun.shell(torchrun.command(task.train, info, job_id, wrapper))
    # With checkpoints the job is not exec'd: the restore comes first, the watch beside it.
    return storage.wrap_body(task, node, cmd) if task.checkpoints else "exec " + cmd


def run_body(task: Task, node: NodeRow) -> str:
    body = str(task.run)
    return storage.wrap_body(task, node, "{\n" + body + "\n}") if task.checkpoints else body


@dataclass(frozen=True)
class NodeFacts:
    bootstrapped: bool
    sync_fp: str
    setup_hash: str


def prep_command(handle: Handle, task: Task) -> Callable[[NodeRow], str]:
    """The prep's command on each node: is it bootstrapped with these scripts, and what was
    last synced and set up there (folded into the launch's node-guard round trip)."""
    boot_env = bootstrap_env(handle, task.bootstrap)
    plan_mounts = list(task.file_mounts)

    def cmd(n: NodeRow) -> str:
        root = shlex.quote(n.root_dir)
        stamp = shlex.quote(bootstrap.stamp_path(n, boot_env(n)))
        mk = " ".join(shlex.quote(str(PurePosixPath(sync.mount_target(n, m)).parent)) for m in plan_mounts)
        # bash builtins only: no process started on the node unless a folder is missing
        return bash(f"for d in {root}/workdir {root}/jobs {mk}; do "
                    "[ -d \"$d\" ] || mkdir -p \"$d\"; done; "
                    f"if [ -f {stamp} ]; then echo boot=yes; fi; s='' h=''; "
                    f"{{ read -r s < {root}/.sync-fp; read -r h < {root}/.setup-hash; }} "
                    "2>/dev/null; echo \"sync=$s\"; echo \"setup=$h\"")
    return cmd


def prep_facts(res: GroupResult) -> dict[int, NodeFacts]:
    """What prep_command's output says, per node (raises when a node failed it)."""
    res.raise_on_failure("Preparing the nodes")
    out = {}
    for rank, r in res.items():
        kv = dict(line.split("=", 1) for line in r.stdout.splitlines()
                  if line.split("=", 1)[0] in ("boot", "sync", "setup"))
        out[rank] = NodeFacts(kv.get("boot") == "yes", kv.get("sync", ""), kv.get("setup", ""))
    return out


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


def run_task(env: Env, handle: Handle, group: Group, task: Task, *, detach: bool = False,
             overrides: dict[str, str] | None = None, job_id: str | None = None,
             guard: Watch | None = None, now: bool = False,
             prep: dict[int, NodeFacts] | None = None) -> Outcome:
    """``prep``: the nodes' facts when the caller already asked (prep_command, folded into
    its own round trip). ``guard``: a budget watch that runs from here until the job ends (foreground only). When
    it reaches the budget, the job is stopped on every node, outputs are pulled back, the
    launch is recorded as BUDGET and :class:`~cloudtrain.budget.BudgetExceeded` is raised (the
    caller tears the cluster down)."""
    if guard is None:
        return _run_task(env, handle, group, task, detach=detach, overrides=overrides,
                         job_id=job_id, guard=None, now=now, prep=prep)
    if detach:
        raise UserError("A budget cannot be watched on a detached launch.",
                        "Run it in the foreground, or launch with --no-budget.")
    guard.start()
    try:
        return _run_task(env, handle, group, task, detach=False, overrides=overrides,
                         job_id=job_id, guard=guard, now=now, prep=prep)
    finally:
        guard.stop()


def _run_guarded(job: RemoteJob, guard: Watch | None, detach: bool = False) -> dict[int, Result]:
    if guard is None:
        return job.run(detach=detach)
    guard.attach(job.stop_for_budget)
    try:
        return job.run(detach=detach)
    finally:
        guard.detach()


def _budget_spent(env: Env, guard: Watch | None, job_id: str | None) -> None:
    """Between steps: raise once the watch has found the budget spent."""
    if guard is None or not guard.exceeded.is_set():
        return
    err = guard.error()
    if job_id is not None:
        env.state.finish_launch(job_id, "BUDGET", err.exit_code, None, err.reason)
    raise err


def _run_task(env: Env, handle: Handle, group: Group, task: Task, *, detach: bool,
              overrides: dict[str, str] | None, job_id: str | None,
              guard: Watch | None, now: bool = False,
              prep: dict[int, NodeFacts] | None = None) -> Outcome:
    overrides = overrides or {}
    job_id = job_id or new_job_id()
    # The fingerprint (a local rsync listing, ~50 ms even for a small tree) is taken while the
    # nodes answer the prep round trip; again after a bootstrap (edits made during it count).
    plan = sync_plan(task)
    fp_pool = ThreadPoolExecutor(max_workers=1)
    fp_future: Future[str] | None = fp_pool.submit(plan.fingerprint)
    fp_pool.shutdown(wait=False)
    if prep is None:
        prep = prep_facts(group.run(prep_command(handle, task)))
    if now:
        queue.refuse_if_busy(handle, group)   # launch --now on a busy cluster: exit 2
    if not all(f.bootstrapped and n.python_bin for n, f in zip(handle.nodes, prep.values())):
        env.ui.step("Bootstrapping")
        run_bootstrap(env, handle, group, task.bootstrap)
        fp_future = None
    _budget_spent(env, guard, None)
    nodes = handle.nodes
    ranks = [n.rank for n in nodes]
    if task.train is not None:
        missing = [n.rank for n in nodes if (n.python_bin is None)]
        no_torch = [n.rank for n in nodes
                    if n.python_bin is not None and n.bootstrap.get("torch", "missing") == "missing"]
        if missing or no_torch:
            raise UserError(
                f"'train:' needs PyTorch on every node; node(s) {missing + no_torch} have none.",
                "Let bootstrap install it (cloudtrain up), or name a Python environment that has "
                "it (resources.local.python on the local provider).")

    # 1. sync, skipped where the node already has this exact content
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
        queue.refuse_changes_while_busy(handle, group, " and ".join(changes))
    if stale and (plan.workdir is not None or plan.mounts):
        env.ui.step(f"Syncing {plan.workdir or 'file mounts'} to {len(stale)} node(s)")
        errors = sent.push_all(env, handle, plan, stale,
                               {n.rank: prep[n.rank].sync_fp for n in stale}, fp)
        bad = {r: e for r, e in errors.items() if e is not None}
        if bad:
            raise RemoteError("Sync failed: " + "; ".join(f"node {r}: {e}" for r, e in bad.items()),
                              "Check the nodes with 'cloudtrain status' and run launch again.")
        env.ui.ok(f"Synced in {time.monotonic() - t0:.2f}s")
    _mark(group, [n.rank for n in stale], ".sync-fp", fp)
    _budget_spent(env, guard, None)

    # 1b. bucket file_mounts: every node fetches them itself, before setup
    storage.check_rclone(handle, task)
    storage.fetch_mounts(env, handle, group, task, {
        n.rank: job_env(env, handle, n, task.envs, job_id + "-fetch", overrides) for n in nodes})
    _budget_spent(env, guard, None)

    logs = env.logs_dir(handle.name) / job_id
    env.state.add_launch(handle.name, job_id, task.name, detach)
    env.state.set_job_envs(handle.name, {**task.envs, **overrides})   # for exec

    # 2. setup, once per (setup, workdir content) per node
    if task.setup:
        todo = [n.rank for n in nodes if prep[n.rank].setup_hash != setup_hash]
        if todo:
            env.ui.step(f"Running setup on {len(todo)} node(s)")
            sink = LogSink(env, logs, ".setup", echo=True)
            scripts = {n.rank: script(n, job_env(env, handle, n, task.envs, job_id + "-setup", overrides),
                                      task.setup) for n in nodes}
            job = RemoteJob(env, handle, group, job_id + "-setup", scripts, sink, todo,
                       grace=task.stop_grace)
            try:
                res = _run_guarded(job, guard)
            except Interrupted:
                env.state.finish_launch(job_id, "INTERRUPTED", 130, None)
                raise
            finally:
                sink.close()
            _budget_spent(env, guard, job_id)
            _raise_if_lost(env, job, job_id)
            first = job.first_failure()
            if first is not None:
                rank, code = first
                env.state.finish_launch(job_id, "FAILED", code or 1, rank)
                raise JobFailed(code or 1, rank, f"setup failed on node {rank} (exit code {code}).",
                                f"See the output above, or 'cloudtrain logs {handle.name} --node {rank}'.")
            _mark(group, [r for r in todo if res[r].ok], ".setup-hash", setup_hash)
        else:
            env.ui.info("Setup unchanged since the last run on every node: skipped")

    # 3. run on every node at once
    if task.train is not None:
        bodies = {n.rank: train_body(handle, n, task, job_id) for n in nodes}
    else:
        bodies = {n.rank: run_body(task, n) for n in nodes}
    scripts = {n.rank: script(n, job_env(env, handle, n, task.envs, job_id, overrides, task),
                              bodies[n.rank])
               for n in nodes}
    sink = LogSink(env, logs, "", echo=True)
    with open(logs / "job.txt", "w", opener=paths.private_opener) as f:
        f.write(f"job_id={job_id}\ncluster={handle.name}\nnodes={len(nodes)}\n")
    env.ui.step(f"Running job {job_id} on {len(nodes)} node(s)")
    outputs.record(env, handle.name, job_id, task)
    turn = queue.Turn(env, handle, group, job_id, task.name or "-")
    job = RemoteJob(env, handle, group, job_id, scripts, sink, ranks, grace=task.stop_grace,
                    turn=turn)
    try:
        res = _run_guarded(job, guard, detach=detach)
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
    if guard is not None and guard.exceeded.is_set():
        # Stopped for the budget: what the job wrote (a checkpoint on SIGTERM) comes back
        # before the caller tears the cluster down.
        if task.outputs:
            pull_outputs(env, handle, task, job_id)
        _budget_spent(env, guard, job_id)
    if detach:
        not_started = [r for r in res.values() if not r.ok]
        if not_started:
            job.stop_everywhere("The job did not start on every node: stopping it")
            env.state.finish_launch(job_id, "FAILED", 1, not_started[0].rank)
            raise RemoteError(f"the job did not start on node {not_started[0].rank}: "
                              f"{not_started[0].error or not_started[0].stdout.strip()}",
                              "Check the node with 'cloudtrain status'.")
        if task.outputs:
            env.ui.info(f"Its outputs ({', '.join(task.outputs)}) stay on the nodes: 'cloudtrain "
                        f"outputs {handle.name}' pulls them ('down' does too, first).")
        return Outcome(job_id, 0, detached=True, queued=turn.queued)

    _raise_if_lost(env, job, job_id)
    outcome = Outcome(job_id, 0, node_codes={r: res[r].exit_code for r in ranks})
    first = job.first_failure()
    if first is not None:
        rank, code = first
        outcome.exit_code, outcome.failed_node = (code if code else 1), rank
        if task.train is not None:
            worker = read_worker_failures(group, handle, job_id)
            if worker is not None:
                outcome.failed_node, outcome.failed_rank, outcome.exit_code = worker
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
    envs = env.state.job_envs(handle.name)   # the last launch's task envs and --env
    scripts = {n.rank: script(n, job_env(env, handle, n, envs, job_id, {}), command)
               for n in handle.nodes}
    sink = LogSink(env, env.logs_dir(handle.name) / job_id, "", echo=True, raw=len(ranks) == 1)
    others = [n.rank for n in handle.nodes if n.rank not in ranks]
    # exec --node: the other nodes' guards hear from the CLI too, meanwhile
    beside = threading.Thread(target=node_guard.touch, args=(env, handle, group),
                              kwargs={"ranks": others}, daemon=True)
    if others:
        beside.start()
    touch, src = node_guard.command(env, handle, "touch", None), node_guard.guard_source()
    job = RemoteJob(env, handle, group, job_id, scripts, sink, ranks, stop_on_failure=False,
                    before=lambda n: (touch(n), src))
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
