"""``cloudtrain preflight NAME``: prove a cluster's GPUs and network before a paid run
(cloudtrain/preflight/, docs/preflight.md).

Only click is imported at module level; the command imports what it needs when it runs.
"""

from __future__ import annotations

import json
import re

import click

from cloudtrain.commands.base import CONTEXT, check_name, guard, open_env


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB|K|M|G)?\s*", value, re.I)
    if not m:
        raise click.BadParameter(f"'{value}' is not a size; write e.g. 64MiB, 1GiB or 65536 "
                                 "(bytes).")
    mult = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[
        (m.group(2) or "")[:1].upper()]
    n = int(m.group(1)) * mult
    if not 4 <= n <= 16 << 30:
        raise click.BadParameter(f"'{value}' is outside 4 bytes .. 16GiB.")
    return n


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--threshold", type=click.FloatRange(min=0, max=100, min_open=True), default=70.0,
              show_default=True, metavar="PERCENT",
              help="A figure below this share of its reference or of the cluster's median "
                   "fails.")
@click.option("--max-size", "max_size", callback=_size, metavar="SIZE",
              help="The all-reduce's largest size (default: 1GiB with NCCL, 64MiB with gloo).")
@click.option("--iters", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Timed iterations per size (after 2 warm-up ones) and per node pair.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: per node its checks and figures, per size the "
                   "algorithm and bus bandwidth, the transport, the verdict.")
@click.option("-v", "--verbose", is_flag=True, help="Show the nodes' output live.")
@guard
def preflight(cluster_name: str, threshold: float, max_size: int | None, iters: int,
              as_json: bool, verbose: bool) -> None:
    """Prove cluster NAME before a paid run: on every node the GPUs (count, model, memory,
    ECC errors, a bf16 matmul each), the driver/CUDA/NCCL/PyTorch versions; then an
    all-reduce across the cluster (NCCL on GPUs, gloo on CPUs) over sizes doubling up to
    1 GiB, its algorithm and bus bandwidth as nccl-tests defines them, the transport NCCL
    chose, and each pair of neighbouring nodes' link. Compared with the instance type's
    reference (docs/preflight.md) and with the cluster's median.

    Exits 0 when every check passes, 4 when one fails (the verdict names the node, GPU or
    link), 1 when it could not reach the nodes, 2 on bad input."""
    from cloudtrain.commands.jobs import not_stopped
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt
    from cloudtrain.preflight import flow, show
    from cloudtrain.preflight.runner import EXIT_FAILED, Options

    stop_signals_as_interrupt()
    check_name(cluster_name)
    env = open_env(quiet=as_json)
    env.ui.verbose = verbose
    not_stopped(env, cluster_name)
    result = flow.on_cluster(env, cluster_name, Options(max_size=max_size, iters=iters),
                             threshold / 100)
    if as_json:
        click.echo(json.dumps(show.as_json(result), indent=2))
    else:
        for line in show.text_lines(result):
            click.echo(line)
        click.echo(result.verdict.paragraph)
    if not result.verdict.ok:
        if not as_json:
            env.ui.error(f"Preflight failed (exit {EXIT_FAILED}): fix or replace the node(s) "
                         f"named, or take the cluster down: cloudtrain down {cluster_name}")
        raise SystemExit(EXIT_FAILED)


def register(cli: click.Group) -> None:
    cli.add_command(preflight)
