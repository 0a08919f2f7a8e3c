"""``cloudtrain outputs``: bring a job's outputs back at any time.

Only click is imported at module level; the SSH and rsync code is imported when it runs.
"""

from __future__ import annotations

import click

from cloudtrain.commands.base import CONTEXT, check_name, guard, open_env


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--job", "job_id", metavar="ID",
              help="The job whose outputs to pull (default: the latest that declared some).")
@guard
def outputs(cluster_name: str, job_id: str | None) -> None:
    """Pull a job's outputs (the task's 'outputs:') from the nodes into its outputs folder,
    as an attached launch does when the job ends: safely staged, never through a link.

    Works while the job runs (what it wrote so far) and after it ended; 'down' pulls the
    outputs of a job that were never pulled before it removes the nodes.

    \b
    Example:
      cloudtrain launch train.yaml -d
      cloudtrain outputs my-job"""
    from cloudtrain.pipeline import pullnow

    check_name(cluster_name)
    env = open_env()
    row, got, ended = pullnow.pull_job(env, cluster_name, job_id)
    if not ended:
        env.ui.warn(f"job {row.job_id} has not ended: these are its outputs so far (run this "
                    "again once it ends; 'down' pulls them then)")
    elif not got:
        env.ui.info(f"job {row.job_id}: none of its outputs exist on the nodes")


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(outputs)
