"""The override options ``up``, ``launch`` and ``cost`` share (cloudtrain/overrides.py), and
the one way a command turns them into an :class:`~cloudtrain.overrides.Overrides`.

Only click is imported at module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import click

if TYPE_CHECKING:
    from cloudtrain.overrides import Change, Overrides
    from cloudtrain.ui import UI

NAMES = ("gpus", "num_nodes", "use_spot", "provider_override", "region")


def override_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --gpus, --num-nodes, --use-spot/--no-use-spot, --provider and --region."""
    for opt in reversed((
        click.option("--gpus", "gpus", metavar="NAME:COUNT",
                     help="GPUs per node, over the task's resources.accelerators (e.g. A100:8)."),
        click.option("--num-nodes", "num_nodes", type=int, metavar="N",
                     help="Number of nodes, over the task's num_nodes."),
        click.option("--use-spot/--no-use-spot", "use_spot", default=None,
                     help="Spot (or on-demand) nodes, over the task's resources.use_spot."),
        click.option("--provider", "provider_override", metavar="P",
                     help="Provider, over the task's resources.provider (aws, gcp, azure, "
                          "local, ssh)."),
        click.option("--region", "region", metavar="R",
                     help="Region, over the task's resources.region."),
    )):
        fn = opt(fn)
    return fn


def overrides_from(options: dict[str, Any], run: tuple[str, ...] | None = None) -> Overrides:
    """The overrides in a command's options (which it pops: the rest are the command's own)."""
    from cloudtrain.overrides import Overrides

    return Overrides(gpus=options.pop("gpus"), num_nodes=options.pop("num_nodes"),
                     use_spot=options.pop("use_spot"), provider=options.pop("provider_override"),
                     region=options.pop("region"), run=run)


def show_changes(ui: UI, changes: list[Change], in_plan: bool = True) -> None:
    """The plan's lines (or, outside a plan, one line each) for what the command line
    overrode."""
    for c in changes:
        ui.info(f"  {'override':<13}{c.words()}" if in_plan else f"Override: {c.words()}")
