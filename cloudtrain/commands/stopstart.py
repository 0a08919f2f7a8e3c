"""``cloudtrain stop`` and ``start``: a cluster's nodes stopped and started again where the
provider can (pipeline/stopstart.py).

Only click is imported at module level; each command imports what it needs when it runs.
"""

from __future__ import annotations

import sys

import click

from cloudtrain.commands.base import CONTEXT, check_name, guard, open_env


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option("--force", is_flag=True,
              help="Stop even while a job runs or waits on the cluster (the job is killed).")
@guard
def stop(cluster_name: str, yes: bool, force: bool) -> None:
    """Stop a cluster's nodes, keeping their disks: compute stops billing (the cost ledger
    stops counting it), the disks may still bill. 'cloudtrain start NAME' (or 'up' and
    'launch' on it) brings the same nodes back, with their files.

    Refused (exit 2) while a job runs or waits on the cluster, unless --force, and on a
    provider that cannot stop its nodes (ssh: your own machines)."""
    from cloudtrain.pipeline import stopstart
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    check_name(cluster_name)
    env = open_env()
    stopstart.stoppable(env, cluster_name)       # refused before asking
    if not yes and sys.stdin.isatty() and not click.confirm(
            f"Stop {cluster_name}?", default=True, err=True):
        return
    done = stopstart.stop(env, cluster_name, force=force)
    if done.already:
        env.ui.info(f"Cluster '{cluster_name}' is stopped already. While stopped: "
                    f"{done.still_bills}")
        return
    env.ui.ok(f"Cluster '{cluster_name}' is stopped: compute no longer bills. "
              f"{done.still_bills} Start it again: cloudtrain start {cluster_name}")


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@guard
def start(cluster_name: str, yes: bool) -> None:
    """Start a stopped cluster's nodes again (the same nodes, disks and files), wait for
    SSH and restart the node guards with the cluster's saved policy. Compute bills again
    from now, at the cluster's recorded price."""
    from cloudtrain.pipeline import stopstart
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    check_name(cluster_name)
    env = open_env()
    row, _ = stopstart.stoppable(env, cluster_name)
    price = (f" (about ${row.hourly_price * row.num_nodes:.2f}/hour while it runs)"
             if row.hourly_price else "")
    if not yes and sys.stdin.isatty() and not click.confirm(
            f"Start {cluster_name}{price}?", default=True, err=True):
        return
    handle = stopstart.start(env, cluster_name)
    if handle is None:
        env.ui.info(f"Cluster '{cluster_name}' runs already: nothing to start.")
        return
    env.ui.ok(f"Cluster '{cluster_name}' is up again: {len(handle.nodes)} node(s) on "
              f"{handle.row.provider}.")


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    for command in (stop, start):
        cli.add_command(command)
