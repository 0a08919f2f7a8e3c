"""``cloudtrain sweep``: many trials searched by Optuna on one cluster (docs/sweep.md).

One group takes a sweep file or a subcommand: ``cloudtrain sweep SWEEP.yaml [-c NAME] [-y]``
starts a sweep (the group hands arguments whose first is not one of its subcommands, nor
--help, to its hidden ``start`` command, so options may come before the file);
``sweep status NAME``, ``sweep results NAME [--json|--csv|--plot FILE.png]`` and
``sweep cancel NAME`` read and stop it. Only click is imported at module level.
"""

from __future__ import annotations

import click

from cloudtrain.commands.base import CONTEXT, confirm_cost, guard, open_env


class SweepGroup(click.Group):
    """A group whose first argument is a subcommand, or else the sweep file to start."""

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            return "start", self.commands["start"], args
        return super().resolve_command(ctx, args)


@click.group(cls=SweepGroup, context_settings={**CONTEXT, "ignore_unknown_options": True})
def sweep() -> None:
    """Search hyperparameters with Optuna on one cluster: SWEEP.yaml starts a sweep.

    \b
      cloudtrain sweep SWEEP.yaml [-c NAME] [-y] [--recover]
                                                   start it (the name is the file's stem)
      cloudtrain sweep status NAME                 trials, best so far, spend, progress
      cloudtrain sweep results NAME [--json|--csv|--plot FILE.png]
      cloudtrain sweep outputs NAME                pull ended trials' outputs (best: link)
      cloudtrain sweep cancel NAME                 stop it (trials get SIGTERM and their grace)

    The sweep runs on the cluster's head node and goes on with this laptop closed; its
    max_cost_usd and down: are enforced by the node guards (docs/sweep.md)."""


@sweep.command(name="start", hidden=True, context_settings=CONTEXT)
@click.argument("sweep_file", type=click.Path(dir_okay=False, exists=True))
@click.option("-c", "--cluster", "cluster_name", help="Cluster (default: the file's cluster:).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before spending money.")
@click.option("--recover", is_flag=True,
              help="Replace nodes the cloud takes; the sweep resumes from the study kept in "
                   "the task's checkpoints: bucket (this terminal is the controller).")
@guard
def start(sweep_file: str, cluster_name: str | None, yes: bool, recover: bool) -> None:
    """Start the sweep SWEEP_FILE: refused (exit 2, nothing created) when its trials cannot
    fit max_cost_usd; the cluster is created when it does not exist."""
    from cloudtrain.pipeline import plan, sweep as sweeps, sweeprecover

    sw = sweeps.load(sweep_file, cluster_name)
    if sweeprecover.wanted(sw, recover):
        sweeprecover.check(sw)
    env = open_env()
    planned = plan.plan(env, sw.task, sw.cluster)
    if sweeprecover.wanted(sw, recover):
        sweeprecover.start(env, sw, planned, lambda p: confirm_cost(p, yes))
        env.ui.ok(f"Sweep {sw.name} finished. Its trials: cloudtrain sweep results {sw.name}")
        return
    rec = sweeps.start(env, sw, planned, lambda p: confirm_cost(p, yes))
    env.ui.ok(f"Sweep {rec.name} started on cluster {rec.cluster}: it runs on the head node. "
              f"Follow it: cloudtrain sweep status {rec.name}")


@sweep.command(name="status", context_settings=CONTEXT)
@click.argument("name")
@guard
def status(name: str) -> None:
    """Trials running/done/pruned/failed, the best so far, spend and the estimate to the end."""
    from cloudtrain.pipeline import sweepread

    res = sweepread.read(open_env(), name)
    click.echo("\n".join(sweepread.status_lines(res)))


@sweep.command(name="results", context_settings=CONTEXT)
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One JSON document.")
@click.option("--csv", "as_csv", is_flag=True, help="One CSV row per trial.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="Write the optimisation history and parameter importance to this PNG.")
@guard
def results(name: str, as_json: bool, as_csv: bool, plot_file: str | None) -> None:
    """Every trial's params, objective, state, duration, GPUs and cost; the best marked *."""
    import json

    from cloudtrain.pipeline import sweepout, sweepread

    env = open_env()
    res = sweepread.read(env, name)
    said = sweepout.after_results(env, res.record.cluster, name, res.as_dict())
    if said:                                     # finished trials' outputs, the best named
        click.echo(said, err=True)
    if plot_file:
        from cloudtrain.pipeline.sweepplot import plot

        click.echo(f"Plot written to {plot(res, plot_file)}", err=as_json or as_csv)
    if as_json:
        click.echo(json.dumps(res.as_dict(), indent=1))
    elif as_csv:
        click.echo(sweepread.csv_text(res), nl=False)
    elif not plot_file:
        click.echo(sweepread.table(res))


@sweep.command(name="outputs", context_settings=CONTEXT)
@click.argument("name")
@guard
def outputs(name: str) -> None:
    """Pull the ended trials' outputs into OUTPUTS_DIR/sweep-NAME/trial-N (the best: link best)."""
    from cloudtrain.pipeline import sweepout, sweepread

    env = open_env()
    res = sweepread.read(env, name)
    click.echo(sweepout.pull_command(env, res.record.cluster, name, res.as_dict()))


@sweep.command(name="cancel", context_settings=CONTEXT)
@click.argument("name")
@guard
def cancel(name: str) -> None:
    """Stop the sweep: no new trial starts; running ones get SIGTERM and their stop_grace."""
    from cloudtrain.pipeline import sweepread

    click.echo(sweepread.cancel(open_env(), name))


def register(cli: click.Group) -> None:
    cli.add_command(sweep)
