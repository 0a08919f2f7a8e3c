"""``cloudtrain jobs``: the recovery controllers started with ``launch -d --recover`` (list,
logs, cancel). Only click is imported at module level."""

from __future__ import annotations

import click

from cloudtrain.commands.base import CONTEXT, guard, open_env


@click.group(name="jobs", context_settings=CONTEXT, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@guard
def jobs(ctx: click.Context, as_json: bool) -> None:
    """Background recovery controllers (launch -d --recover) and their state: running,
    succeeded, failed, cancelled, controller-died (its process is gone without a final state;
    the nodes' guards apply the launch's policy)."""
    if ctx.invoked_subcommand is not None:
        return
    import json
    import time

    from cloudtrain.pipeline import controllers

    open_env(quiet=True)
    rows = controllers.listing()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("No controllers.")
        return
    click.echo(f"{'ID':<23} {'CLUSTER':<20} {'STATE':<16} STARTED")
    for r in rows:
        state = "controller died" if r["state"] == "controller-died" else r["state"]
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"]))
        click.echo(f"{r['id']:<23} {r['cluster']:<20} {state:<16} {started}")


@jobs.command(context_settings=CONTEXT)
@click.argument("controller_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the controller ends.")
@guard
def logs(controller_id: str, follow: bool) -> None:
    """Print a controller's log (controller.log)."""
    import sys

    from cloudtrain.pipeline import controllers
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    open_env(quiet=True)
    controllers.follow(controller_id, sys.stdout, follow)


@jobs.command(context_settings=CONTEXT)
@click.argument("controller_id")
@guard
def cancel(controller_id: str) -> None:
    """Stop a controller and its job (SIGTERM on every node, then SIGKILL after stop_grace;
    with --down the cluster is torn down)."""
    from cloudtrain.pipeline import controllers

    env = open_env()
    rec = controllers.cancel(controller_id)
    state = "controller died" if rec["state"] == "controller-died" else rec["state"]
    env.ui.ok(f"Controller {controller_id}: {state}")


def register(cli: click.Group) -> None:
    cli.add_command(jobs)
