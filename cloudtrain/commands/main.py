"""The command line: the ``cloudtrain`` group, the commands registered on it, and ``main``.

Each command lives in a module of this package by topic (cluster: up/status/down; jobs:
launch/exec/logs/ssh; init; catalog; cost; report; gc). Only click is imported at module
level so that ``cloudtrain --help`` starts fast and never imports a cloud SDK; each command
imports what it needs when it runs.
"""

from __future__ import annotations

import click

from cloudtrain.commands import (access, budget, catalog, check, cluster, controllers, cost, gc,
                                 init, jobs, monitor, outputs, preflight, queue, report, stopstart,
                                 sweep)
from cloudtrain.commands.base import CONTEXT


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="cloudtrain", prog_name="cloudtrain")
def cli() -> None:
    """cloudtrain: run a training job on N GPU machines (AWS, GCP, Azure, your own hosts or
    local nodes), know what it costs, and leave nothing running.

    \b
    Quick start:
      cloudtrain launch task.yaml --down     provision, sync, train, tear down
      cloudtrain status                      what is running
      cloudtrain down NAME                   tear a cluster down

    State lives in $CLOUDTRAIN_HOME (default: your user data directory).
    """


def register_commands() -> None:
    for module in (init, cluster, jobs, controllers, catalog, cost, report, gc, access, monitor,
                   queue, outputs, budget, sweep, check, stopstart, preflight):
        module.register(cli)


register_commands()


def main() -> None:
    cli(prog_name="cloudtrain")


if __name__ == "__main__":
    main()
