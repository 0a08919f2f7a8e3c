"""``cloudtrain gc``: find (and with -y remove) cloud resources cloudtrain tagged that no live
cluster owns (cloudtrain/pipeline/gc.py does the finding and removing).

Only click is imported at module level.
"""

from __future__ import annotations

import json
import sys

import click

from cloudtrain.commands.base import CONTEXT, guard, open_env


@click.command(name="gc", context_settings=CONTEXT)
@click.option("--provider", "provider_name", metavar="NAME",
              help="Only this provider (default: every installed cloud; those without "
                   "their SDK or credentials are skipped with a note).")
@click.option("--all-regions", is_flag=True,
              help="Search every enabled region (default: the default region and the "
                   "regions of this machine's clusters).")
@click.option("--any-owner", is_flag=True,
              help="Also resources of another CLOUDTRAIN_HOME, user or machine, and those "
                   "an older cloudtrain tagged without a home id (careful: their live "
                   "clusters are unknown here and would be listed as orphans).")
@click.option("--force", is_flag=True,
              help="Also terminate instances that are still running (without it, gc only "
                   "lists them and prints the command that would).")
@click.option("-y", "--yes", is_flag=True, help="Remove what is listed without asking.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@guard
def gc(provider_name: str | None, all_regions: bool, any_owner: bool, force: bool,
       yes: bool, as_json: bool) -> None:
    """List resources tagged by this CLOUDTRAIN_HOME that no live cluster owns; remove them
    with -y (instances first, then security groups, key pairs, placement groups, volumes).
    Another home's resources (same user@host) are shown and left alone; a running
    instance is only terminated with --force."""
    from cloudtrain.pipeline.gc import Sweep, collect

    env = open_env(quiet=as_json)
    can_ask = sys.stdin.isatty() and not as_json
    report, failed = collect(
        env, Sweep(provider_name, all_regions, any_owner, force), yes=yes,
        confirm=_ask if can_ask else None)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    if failed:
        sys.exit(max(e.exit_code for e in failed))


def _ask(count: int) -> bool:
    return click.confirm(f"Remove these {count} resource(s)?", default=False, err=True)


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(gc)
