"""``cloudtrain top``: the nodes' GPU use, refreshed live.

Only click is imported at module level; rich and the SSH code are imported when ``top`` runs.
"""

from __future__ import annotations

import click

from cloudtrain.commands.base import CONTEXT, check_name, finite, guard, open_env


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--interval", type=click.FloatRange(min=0.5, max=3600), default=2.0,
              show_default=True, callback=finite, metavar="S",
              help="Seconds between refreshes (0.5 to 3600).")
@click.option("--once", is_flag=True, help="Print one frame and exit (scripts, logs).")
@guard
def top(cluster_name: str, interval: float, once: bool) -> None:
    """Show every node's GPUs live: utilisation, memory, temperature and power.

    One SSH connection per node stays open and each refresh runs one nvidia-smi query per
    node over it. During a running job, GPUs with about 0 % utilisation and almost no memory
    in use are marked IDLE. Nodes without nvidia-smi show "no GPU". Ctrl-C quits.

    \b
    Example:
      cloudtrain top my-job --interval 1
      cloudtrain top my-job --once"""
    from cloudtrain.pipeline import monitor

    check_name(cluster_name)
    monitor.top(open_env(), cluster_name, interval, once)


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(top)
