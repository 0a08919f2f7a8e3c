"""``cloudtrain launch``, ``exec``, ``logs`` and ``ssh``: running things on a cluster.

Only click is imported at module level; each command imports what it needs when it runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from cloudtrain.commands.access import ssh_config_choice
from cloudtrain.commands.base import (CONTEXT, check_name, confirm_cost, finite, guard, load_task,
                                      open_env)

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.pipeline.request import Launch
    from cloudtrain.pipeline.run import Outcome


@click.command(context_settings=CONTEXT)
@click.argument("task_file", type=click.Path(dir_okay=False))
@click.option("-c", "--cluster", "cluster_name", help="Cluster name (default: the task's name).")
@click.option("--down", "down_after", is_flag=True,
              help="Tear the cluster down after the run, whatever happened (the nodes do it "
                   "themselves if this CLI is gone, and with -d).")
@click.option("-d", "--detach", is_flag=True, help="Start the job and return; see 'logs --follow'.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before spending money.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Extra environment (repeatable).")
@click.option("--max-cost", "max_cost", type=click.FloatRange(min=0, min_open=True), metavar="USD",
              callback=finite,
              help="Budget for the cluster in USD (overrides the task's max_cost_usd).")
@click.option("--hours", "hours", type=click.FloatRange(min=0, min_open=True), metavar="H",
              callback=finite,
              help="Hours the run may take, for the budget's estimate (overrides max_hours).")
@click.option("--no-budget", is_flag=True, help="Ignore max_cost_usd: no estimate, no watch.")
@click.option("--recover", is_flag=True,
              help="Replace nodes the cloud takes and resume the job (docs/recovery.md).")
@click.option("--now", is_flag=True,
              help="Refuse (exit 2) when a job runs or waits on the cluster, instead of "
                   "waiting its turn in the cluster's queue (docs/queue.md).")
@click.option("-v", "--verbose", is_flag=True,
              help="Show every rank's output live, torchrun's tracebacks too (a failed train "
                   "job otherwise shows the failing rank's last lines; all go to the logs).")
@ssh_config_choice(ask=False)
@guard
def launch(task_file: str, cluster_name: str | None, yes: bool, envs: tuple[str, ...],
           **options: Any) -> None:
    """Run TASK_FILE on a cluster: up if needed, sync, setup, run on every node, stream logs.

    With a budget (max_cost_usd, or --max-cost), launch refuses (exit 2, nothing created)
    when what the cluster has cost so far plus its $/h x hours (--hours, or max_hours)
    exceeds it, or when no hours are given. While the job runs it warns at 80% of the budget
    and, at 100%, stops the job everywhere, tears the cluster down and exits 3. The budget
    covers the whole cluster, earlier launches on it included. The node guards enforce
    the budget and --down too, so they hold with -d and when this CLI is gone (docs/guard.md).

    Exits with the job's exit code (the first failing node's), 3 when the budget was
    reached, 130 on Ctrl-C."""
    from cloudtrain.pipeline import job
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    verbose = options.pop("verbose")
    env, req = launch_request(task_file, cluster_name, yes, envs, options)
    env.ui.verbose = verbose
    outcome = job.launch(env, req)
    if outcome is not None:
        env.ui.ok(outcome_line(outcome, req.name))


def launch_request(task_file: str, cluster_name: str | None, yes: bool, envs: tuple[str, ...],
                   options: dict[str, Any]) -> tuple[Env, Launch]:
    """The launch the command line asks for, built once (pipeline/request.py), with the
    environment it runs in; the task, --env and the budget are checked before anything is
    opened or created. ``options``: launch's other options, by their names."""
    from cloudtrain import budget
    from cloudtrain.cluster import resolve_name
    from cloudtrain.pipeline import plan
    from cloudtrain.pipeline.request import CommandLine, Launch

    task = load_task(task_file)
    overrides = parse_env(envs)
    limit = budget.resolve(task.max_cost_usd, task.max_hours, max_cost=options["max_cost"],
                           hours=options["hours"], no_budget=options["no_budget"])
    env = open_env()
    name = resolve_name(task, cluster_name, task_file)
    return env, Launch(task, name, plan.plan(env, task, name),
                       down_after=options["down_after"], detach=options["detach"],
                       overrides=overrides, budget=limit, no_budget=options["no_budget"],
                       now=options["now"], recover=options["recover"] or task.recovery is not None,
                       confirm=lambda planned: confirm_cost(planned, yes),
                       command_line=CommandLine(task_file, options["max_cost"], options["hours"]))


def outcome_line(outcome: Outcome, name: str) -> str:
    """What a launch that did not fail says last."""
    if not outcome.detached:
        return f"Job {outcome.job_id} succeeded on every node"
    if outcome.queued:
        return (f"Job {outcome.job_id} queued on every node: the nodes start it when its turn "
                f"comes (cloudtrain queue {name}).")
    return f"Job {outcome.job_id} started on every node. Follow it: cloudtrain logs {name} --follow"


def parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    """``--env K=V`` options, as a dict."""
    from cloudtrain.errors import UserError

    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.isidentifier():
            raise UserError(f"--env '{p}' is not KEY=VALUE.", "Write e.g. --env LR=0.1")
        out[k] = v
    return out


@click.command(name="exec", context_settings=CONTEXT)
@click.argument("cluster_name")
@click.argument("command", nargs=-1, required=True)
@click.option("--node", "node", type=int, help="Only this node (rank); default: every node.")
@guard
def exec_(cluster_name: str, command: tuple[str, ...], node: int | None) -> None:
    """Run COMMAND on the cluster's nodes (after '--'), with the job environment."""
    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.pipeline import run
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    check_name(cluster_name)
    env = open_env()
    handle = get_handle(env, cluster_name)
    ranks = node_ranks(handle, node)
    group = connect(env, handle, timeout=30)
    try:
        code, failed = run.run_command(env, handle, group, " ".join(command), ranks)
    finally:
        group.close()
    if code != 0:
        from cloudtrain.errors import JobFailed

        raise JobFailed(code, failed, f"The command exited with code {code} on node {failed}.")


def node_ranks(handle: Handle, node: int | None) -> list[int]:
    """Every node's rank, or only ``node`` (which must be one of the cluster's)."""
    from cloudtrain.errors import UserError

    ranks = [n.rank for n in handle.nodes]
    if node is None:
        return ranks
    if node not in ranks:
        raise UserError(f"Cluster '{handle.name}' has no node {node}.",
                        f"Its nodes are 0..{len(ranks) - 1}.")
    return [node]


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--node", "node", type=int, help="Only this node (rank).")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming while the job runs.")
@click.option("--job", "job_id", help="A job id (default: the latest).")
@click.option("--guard", "guard_log", is_flag=True,
              help="Show each node's guard log (its autostop decisions) instead.")
@guard
def logs(cluster_name: str, node: int | None, follow: bool, job_id: str | None,
         guard_log: bool) -> None:
    """Replay the logs of the cluster's latest job (or --job), prefixed by node."""
    from cloudtrain.pipeline import guard as node_guard
    from cloudtrain.pipeline.logs import show
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    check_name(cluster_name)
    env = open_env()
    if guard_log:
        node_guard.show_log(env, cluster_name, node)
        return
    if env.state.get_cluster(cluster_name) is not None:
        node_guard.contact(env, cluster_name)
    show(env, cluster_name, node=node, follow=follow, job_id=job_id)


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--node", "node", type=int, default=0, show_default=True, help="Node rank.")
@guard
def ssh(cluster_name: str, node: int) -> None:
    """Open an SSH session on a node, with the cluster's key and pinned host key. While it
    lasts, the cluster's idle stop waits (the session keeps every node alive)."""
    import shutil
    import signal
    import subprocess

    from cloudtrain.cluster import get_handle
    from cloudtrain.errors import UserError
    from cloudtrain.keys import ssh_command_options
    from cloudtrain.pipeline import guard as node_guard
    from cloudtrain.sshmux import reuse_options

    check_name(cluster_name)
    env = open_env(quiet=True)
    handle = get_handle(env, cluster_name)
    n = handle.nodes[node_ranks(handle, node)[0]]
    exe = shutil.which("ssh")
    if exe is None:
        raise UserError("The 'ssh' client is not installed.", "Install OpenSSH's client.")
    args = ["ssh", *reuse_options(handle.keys, n),    # over the node's master when it answers
            *ssh_command_options(handle.keys, n.port, n.identity_file), "-t", "--", f"{n.user}@{n.host}"]
    sys.stdout.flush()
    stop = node_guard.keep_alive(env, cluster_name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the remote shell's
    try:
        code = subprocess.call(args, executable=exe)
    finally:
        stop()
    sys.exit(code)


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    for command in (launch, exec_, logs, ssh):
        cli.add_command(command)
