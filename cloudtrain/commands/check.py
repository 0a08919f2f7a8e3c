"""``cloudtrain check [PROVIDER...]``: which providers are usable here (cloudtrain/check.py
does the asking). Only click is imported at module level: no cloud SDK at ``--help`` time.
"""

from __future__ import annotations

import json
import sys

import click

from cloudtrain.commands.base import CONTEXT, guard, handed_providers


@click.command(name="check", context_settings=CONTEXT)
@click.argument("providers", nargs=-1, metavar="[PROVIDER]...")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON list, one object per provider: provider, sdk, credentials, "
                   "works, reaches, detail, fix, usable.")
@click.option("--timeout", "timeout", type=click.FloatRange(0.5, 120), default=5.0,
              show_default=True, metavar="SECONDS",
              help="How long each network call may take (to connect, and to read its answer).")
@guard
def check(providers: tuple[str, ...], as_json: bool, timeout: float) -> None:
    """Which providers are usable here: for each (default: every installed one; aws, gcp,
    azure, local, ssh), whether its SDK is installed, whether credentials are found, and
    whether they work, by cheap read-only calls (AWS: the account and its regions; GCP:
    the project and its zones; Azure: the subscription), each bounded by --timeout
    seconds (a provider's whole check by 20 s, or 4 x --timeout when that is longer).
    Nothing is created. local and ssh need no account and are always usable.

    \b
    Exit codes: 0 when at least one cloud (aws, gcp, azure) checked is usable (or none was
    asked about, e.g. 'cloudtrain check local'); 1 when no cloud checked is usable; 2 for an
    unknown provider name.
    """
    from cloudtrain import check as checks
    from cloudtrain.paths import home_path
    from cloudtrain.provider import registry
    from cloudtrain.provider.contract import ProviderContext

    names = checks.chosen(providers, registry.names())
    results = checks.check(names, ProviderContext(home_path()), handed_providers(),
                           timeout=timeout, deadline=max(checks.DEADLINE, 4 * timeout))
    if as_json:
        click.echo(json.dumps(checks.as_json(results), indent=2))
    else:
        for line in checks.table(results):
            click.echo(line)
    sys.exit(checks.exit_code(results))


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(check)
