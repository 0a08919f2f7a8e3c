"""``cloudtrain init``: start a project from the training template.

Only click is imported at module level.
"""

from __future__ import annotations

import click

from cloudtrain.commands.base import CONTEXT, guard


@click.command(context_settings=CONTEXT)
@click.argument("directory", default=".", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Overwrite files the template would replace.")
@guard
def init(directory: str, force: bool) -> None:
    """Start a project in DIRECTORY from the training template: a DDP training script and
    example tasks (local 2-node demo, AWS 2 x A100:8)."""
    from pathlib import Path

    from cloudtrain.scaffold import scaffold
    from cloudtrain.ui import UI

    ui = UI()
    dest = Path(directory)
    written = scaffold(dest, force=force)
    for p in written:
        ui.info(f"  {p}")
    where = "" if dest.resolve() == Path.cwd().resolve() else f"{directory.rstrip('/')}/"
    ui.ok(f"Project ready ({len(written)} files). Next:\n"
          f"  cloudtrain launch {where}task.yaml --down        # 2 local nodes x 2 processes\n"
          f"  cloudtrain up {where}task-aws.yaml --dry-run     # 2 x A100:8 on AWS: the plan first")


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(init)
