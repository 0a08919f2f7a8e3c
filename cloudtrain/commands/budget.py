"""``cloudtrain budget NAME --max-cost X | --off``: change the cluster's budget on purpose
(a launch only keeps it or makes it stricter; docs/guard.md, "Rules that compose").

Only click is imported at module level."""

from __future__ import annotations

import click

from cloudtrain.commands.base import CONTEXT, check_name, finite, guard, open_env


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--max-cost", "max_cost", type=click.FloatRange(min=0, min_open=True),
              metavar="USD", callback=finite,
              help="The cluster's new budget in USD (higher or lower than the one in force).")
@click.option("--off", is_flag=True, help="No budget on this cluster.")
@guard
def budget(cluster_name: str, max_cost: float | None, off: bool) -> None:
    """Set or lift the budget of a live cluster: the node guards enforce the new one at once.

    A later launch keeps the budget in force, or takes a stricter one it brings; only this
    command (or 'launch --no-budget') raises or lifts it. 'cloudtrain status NAME' shows the
    rules in force and which command set each."""
    from cloudtrain.errors import UserError
    from cloudtrain.pipeline import guard as node_guard, rules

    check_name(cluster_name)
    if off == (max_cost is not None):
        raise UserError("budget needs exactly one of --max-cost USD or --off.",
                        "e.g. cloudtrain budget NAME --max-cost 20, or cloudtrain budget NAME "
                        "--off to lift it.")
    env = open_env()
    pol = node_guard.set_budget(env, cluster_name, max_cost)
    env.ui.ok(f"Budget in force on '{cluster_name}': {rules.budget_words(pol)}")


def register(cli: click.Group) -> None:
    cli.add_command(budget)
