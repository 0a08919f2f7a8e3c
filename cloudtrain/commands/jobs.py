"""``cloudtrain launch``, ``exec``, ``logs`` and ``ssh``: running things on a cluster.

Only click is imported at module level; each command imports what it needs when it runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from cloudtrain.commands.access import ssh_config_choice
from cloudtrain.commands.base import (CONTEXT, check_name, confirm_cost, finite, guard, open_env,
                                      show_notes)
from cloudtrain.commands.overrideopts import override_options, overrides_from, show_changes

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.overrides import Change
    from cloudtrain.schema import NodeRow
    from cloudtrain.pipeline.request import Launch
    from cloudtrain.pipeline.run import Outcome


class AfterDashDash(click.Command):
    """A command whose words after the first '--' are its CMD, kept apart from its optional
    positional argument (click would otherwise hand the first of them to TASK_FILE)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            i = args.index("--")
            ctx.meta["cloudtrain.after_dash"] = tuple(args[i + 1:])
            args = args[:i]
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- CMD...]"]


@click.command(cls=AfterDashDash, context_settings=CONTEXT)
@click.argument("task_file", type=click.Path(dir_okay=False), required=False)
@click.option("-c", "--cluster", "cluster_name", help="Cluster name (default: the task's name).")
@click.option("--down", "down_after", is_flag=True,
              help="Tear the cluster down after the run, whatever happened (the nodes do it "
                   "themselves if this CLI is gone, and with -d).")
@click.option("-d", "--detach", is_flag=True, help="Start the job and return; see 'logs --follow'.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before spending money.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan, what would run and the budget check; create nothing, "
                   "contact no node.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Extra environment (repeatable).")
@override_options
@click.option("--workdir", "workdir", metavar="DIR",
              help="Without a task file: the directory synced to the nodes (default: .).")
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
@click.option("--preflight/--no-preflight", "preflight", default=None,
              help="Prove the cluster first (cloudtrain preflight; a failure stops the launch, "
                   "exit 4). Default: only before the first multi-node launch on a cluster.")
@click.option("-v", "--verbose", is_flag=True,
              help="Show every rank's output live, torchrun's tracebacks too (a failed train "
                   "job otherwise shows the failing rank's last lines; all go to the logs).")
@ssh_config_choice(ask=False)
@guard
def launch(task_file: str | None, cluster_name: str | None, yes: bool, envs: tuple[str, ...],
           **options: Any) -> None:
    """Run TASK_FILE on a cluster: up if needed, sync, setup, run on every node, stream logs.

    \b
    cloudtrain launch task.yaml                  the task as written
    cloudtrain launch task.yaml --gpus A100:8    with overrides (--num-nodes, --use-spot,
                                                 --provider, --region; the plan shows each)
    cloudtrain launch task.yaml -- CMD...        CMD runs instead of the task's run/train
    cloudtrain launch --gpus A100:1 -- CMD...    no task file: a task from the flags, whose
                                                 workdir is --workdir (default .) and whose
                                                 cluster is -c NAME (default: from the workdir)

    With a budget (max_cost_usd, or --max-cost), launch refuses (exit 2, nothing created)
    when what the cluster has cost so far plus its $/h x hours (--hours, or max_hours)
    exceeds it, or when no hours are given. While the job runs it warns at 80% of the budget
    and, at 100%, stops the job everywhere, tears the cluster down and exits 3. The budget
    covers the whole cluster, earlier launches on it included. The node guards enforce
    the budget and --down too, so they hold with -d and when this CLI is gone (docs/guard.md).

    Exits with the job's exit code (the first failing node's), 3 when the budget was
    reached, 4 when its preflight failed (docs/preflight.md), 130 on Ctrl-C."""
    from cloudtrain.pipeline import job
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    verbose = options.pop("verbose")
    after = click.get_current_context().meta.get("cloudtrain.after_dash")
    dry_run = options.pop("dry_run")
    env, req, changes = launch_request(task_file, cluster_name, yes, envs, options, after,
                                       dry_run=dry_run)
    env.ui.verbose = verbose
    if dry_run:
        from cloudtrain.commands.launchplan import show

        return show(env, req, changes)
    show_changes(env.ui, changes, in_plan=False)
    outcome = job.launch(env, req)
    if outcome is not None:
        env.ui.ok(outcome_line(outcome, req.name))


def launch_request(task_file: str | None, cluster_name: str | None, yes: bool,
                   envs: tuple[str, ...], options: dict[str, Any],
                   after: tuple[str, ...] | None = None, *,
                   dry_run: bool = False) -> tuple[Env, Launch, list[Change]]:
    """The launch the command line asks for, built once (pipeline/request.py), with the
    environment it runs in and the overrides applied; the task, the overrides, --env and the
    budget are checked before anything is opened or created. ``options``: launch's other
    options, by their names; ``after``: the words after '--' (None: no '--')."""
    from cloudtrain import budget, overrides
    from cloudtrain.cluster import resolve_name
    from cloudtrain.errors import UserError
    from cloudtrain.pipeline import plan
    from cloudtrain.pipeline.request import CommandLine, Launch

    if task_file is None and after is None:
        click.echo(click.get_current_context().get_usage(), err=True)
        raise UserError("launch needs a task file, or a command after '--'.",
                        "e.g. cloudtrain launch task.yaml, or cloudtrain launch --gpus A100:1 "
                        "-- python train.py")
    if after is not None and not after:
        raise UserError("Nothing follows '--'.", "Write the command after it, e.g. "
                                                  "-- python train.py --epochs 3")
    workdir = options.pop("workdir")
    if workdir is not None and task_file is not None:
        raise UserError("--workdir goes with a launch without a task file; the task file's "
                        "'workdir:' says where its files are.",
                        "Drop --workdir, or set workdir: in the task file.")
    ov = overrides_from(options, run=after)
    env_overrides = overrides.parse_env(envs)
    workdir = workdir or "."
    name_given = cluster_name or (overrides.derived_name(workdir) if task_file is None else None)
    env, base = None, None
    if task_file is None:      # on an existing cluster: its resources and nodes, as they are
        overrides.check_flags(ov)      # bad flags refused before the home is opened
        env = open_env(contact=not dry_run)
        base = overrides.cluster_base(env, name_given)
    task, changes = overrides.load(task_file, ov, name=name_given, workdir=workdir, base=base)
    show_notes(task)
    from cloudtrain.containers.pull import check_credentials
    check_credentials(task.container)     # container.registry_auth's variables, set here?
    recover = options["recover"] or task.recovery is not None
    if options["detach"] and recover and (ov or task_file is None):
        raise UserError("-d with recovery runs a controller that reads the task file again, "
                        "without the command line's overrides or '-- CMD'.",
                        "Write them into a task file, or launch without -d.")
    limit = budget.resolve(task.max_cost_usd, task.max_hours, max_cost=options["max_cost"],
                           hours=options["hours"], no_budget=options["no_budget"])
    env = env or open_env(contact=not dry_run)
    name = resolve_name(task, cluster_name, task_file)
    return env, Launch(task, name, plan.plan(env, task, name),
                       down_after=options["down_after"], detach=options["detach"],
                       overrides=env_overrides, budget=limit, no_budget=options["no_budget"],
                       now=options["now"], recover=recover, preflight=options["preflight"],
                       confirm=lambda planned: confirm_cost(planned, yes),
                       command_line=CommandLine(task_file or "", options["max_cost"],
                                                options["hours"])), changes


def outcome_line(outcome: Outcome, name: str) -> str:
    """What a launch that did not fail says last."""
    if not outcome.detached:
        return f"Job {outcome.job_id} succeeded on every node"
    if outcome.queued:
        return (f"Job {outcome.job_id} queued on every node: the nodes start it when its turn "
                f"comes (cloudtrain queue {name}).")
    return f"Job {outcome.job_id} started on every node. Follow it: cloudtrain logs {name} --follow"


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
    not_stopped(env, cluster_name)
    handle = get_handle(env, cluster_name)
    ranks = node_ranks(handle, node)
    from cloudtrain.pipeline import stepexec
    if stepexec.scheduled(handle):          # Slurm: a step of the allocation, not SSH
        stepexec.run(env, handle, " ".join(command), ranks)
        return
    group = connect(env, handle, timeout=30)
    try:
        code, failed = run.run_command(env, handle, group, " ".join(command), ranks)
    finally:
        group.close()
    if code != 0:
        from cloudtrain.errors import JobFailed

        raise JobFailed(code, failed, f"The command exited with code {code} on node {failed}.")


def not_stopped(env: Env, name: str) -> None:
    """Refuse (exit 2) to reach the nodes of a cluster 'cloudtrain stop' stopped."""
    from cloudtrain.errors import UserError

    row = env.state.get_cluster(name)
    if row is not None and row.status == "STOPPED":
        raise UserError(f"Cluster '{name}' is stopped: its nodes do not run.",
                        f"Start it first: cloudtrain start {name}")


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
    from cloudtrain.pipeline import stepjobs
    if stepjobs.scheduled(env, cluster_name):    # Slurm: through the login node (no SSH)
        return (stepjobs.show_guard_log(env, cluster_name) if guard_log else
                stepjobs.show_logs(env, cluster_name, job_id, follow, node))
    if guard_log:
        node_guard.show_log(env, cluster_name, node)
        return
    if env.state.get_cluster(cluster_name) is not None:
        not_stopped(env, cluster_name)
        node_guard.contact(env, cluster_name)
    show(env, cluster_name, node=node, follow=follow, job_id=job_id)


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--node", "node", type=int, default=0, show_default=True, help="Node rank.")
@click.option("--container", "container", is_flag=True,
              help="A shell inside the node's container (a task with container:).")
@guard
def ssh(cluster_name: str, node: int, container: bool) -> None:
    """Open an SSH session on a node, with the cluster's key and pinned host key. While it
    lasts, the cluster's idle stop waits (the session keeps every node alive)."""
    import shutil
    import signal
    import subprocess

    from cloudtrain.cluster import get_handle, refuse_scheduled
    from cloudtrain.errors import UserError
    from cloudtrain.keys import ssh_command_options
    from cloudtrain.pipeline import guard as node_guard
    from cloudtrain.sshmux import reuse_options

    check_name(cluster_name)
    env = open_env(quiet=True)
    not_stopped(env, cluster_name)
    handle = get_handle(env, cluster_name)
    refuse_scheduled(handle)
    n = handle.nodes[node_ranks(handle, node)[0]]
    remote = container_shell(env, cluster_name, n) if container else []
    exe = shutil.which("ssh")
    if exe is None:
        raise UserError("The 'ssh' client is not installed.", "Install OpenSSH's client.")
    args = ["ssh", *reuse_options(handle.keys, n),    # over the node's master when it answers
            *ssh_command_options(handle.keys, n.port, n.identity_file), "-t", "--", f"{n.user}@{n.host}",
            *remote]
    sys.stdout.flush()
    stop = node_guard.keep_alive(env, cluster_name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the remote shell's
    try:
        code = subprocess.call(args, executable=exe)
    finally:
        stop()
    sys.exit(code)


def container_shell(env: Env, name: str, node: NodeRow) -> list[str]:
    """``ssh --container``: the remote command that opens a shell in the node's container."""
    from cloudtrain.containers import runtime, wrap
    from cloudtrain.errors import UserError

    boxes = runtime.recorded(env, name)
    if node.rank not in boxes:
        raise UserError(f"Cluster '{name}' runs no container: its last launch had no "
                        "'container:' section.",
                        f"Launch a task with 'container:' on it first, or drop --container "
                        f"for a shell on the host: cloudtrain ssh {name}")
    return [wrap.shell_command(node, boxes[node.rank])]


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    for command in (launch, exec_, logs, ssh):
        cli.add_command(command)
