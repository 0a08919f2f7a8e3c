"""``cloudtrain cost-report``: the spend ledger."""

from __future__ import annotations

import sys
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cloudtrain.commands.base import CONTEXT, finite, guard, open_env

if TYPE_CHECKING:
    from cloudtrain.ledger import Report

CHART_EXTRA = "pip install 'cloudtrain[chart]'"


@click.command(name="cost-report", context_settings=CONTEXT)
@click.option("--days", type=click.FloatRange(min=0, min_open=True, max=36500), metavar="N",
              callback=finite,
              help="Only the last N days: each cluster's hours are clipped to that window "
                   "(default: everything recorded).")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: {\"clusters\": [{name, provider, region, "
                   "instance_type, nodes, spot, hours, price_hourly_usd (per node-hour, at "
                   "launch), cost_usd, ...}], \"total_usd\": ...}.")
@click.option("--csv", "as_csv", is_flag=True,
              help="One CSV row per cluster (no totals row: sum cost_usd).")
@click.option("--chart", "chart", type=click.Path(dir_okay=False), metavar="FILE.png",
              help=f"Also write a PNG of daily spend by provider (needs matplotlib: "
                   f"{CHART_EXTRA}).")
@click.option("--sweeps", "sweeps_only", is_flag=True,
              help="The sweeps instead of the clusters (table, or --csv): one row per sweep, "
                   "its trials by state and its spend as last read.")
@click.option("--offline", is_flag=True,
              help="Ask no provider: clusters the state says are running are marked "
                   "unconfirmed (counted up to when their recorded rules stopped them, else "
                   "up to now).")
@guard
def cost_report(days: float | None, as_json: bool, as_csv: bool, chart: str | None,
                sweeps_only: bool, offline: bool) -> None:
    """What every cluster cost, terminated ones included: provider, region, instance, nodes,
    spot, hours, price per node-hour at launch, cost; totals per provider.

    Cost = hours x price per node-hour recorded at launch x nodes, summed over the times
    the cluster's nodes existed (created to terminated, started to stopped). Running
    clusters count up to now, after a check with their provider (as 'status --refresh':
    a cluster whose nodes stopped themselves counts up to when they stopped; --offline asks
    none and marks them unconfirmed). Prices are never looked up again: a newer catalog
    does not change past costs, and a cluster with no recorded price shows "unknown" and is
    left out of the totals. Days on the chart are UTC calendar days. Sweeps follow the
    clusters, one row each (their spend is part of their cluster's cost).
    """
    from cloudtrain.errors import UserError

    if as_json and as_csv:
        raise UserError("--json and --csv are two output formats; pick one.",
                        "e.g. cloudtrain cost-report --json")
    _run(days, as_json, as_csv, chart, offline, sweeps_only)


def _run(days: float | None, as_json: bool, as_csv: bool, chart: str | None,
         offline: bool, sweeps_only: bool = False) -> None:
    import time

    from cloudtrain import ledger, schedledger
    from cloudtrain.pipeline.confirm import confirm

    env = open_env(quiet=as_json or as_csv, contact=not offline)
    loose = confirm(env, offline)
    schedledger.refresh(env, offline)
    now = time.time()
    rows = env.state.usage()
    rep = schedledger.apply(ledger.build(rows, now=now, days=days, unconfirmed=loose),
                            schedledger.load(env.home))
    if chart:
        _check_chart_deps()
    if as_json:
        import json

        doc = ledger.to_json(rep)
        doc["recoveries"] = ledger.recoveries_json(env.state.recoveries())
        doc["sweeps"] = ledger.sweeps_json(env.state)
        click.echo(json.dumps(doc, indent=2))
    elif as_csv:
        import csv

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerows(ledger.sweep_rows(ledger.sweeps_json(env.state)) if sweeps_only
                    else ledger.csv_rows(rep))
    else:
        if not sweeps_only:
            _table(rep)
            for r in env.state.recoveries():
                click.echo(ledger.recovery_line(r))
        _sweep_table(ledger.sweep_rows(ledger.sweeps_json(env.state)), sweeps_only)
    if chart:
        path = Path(chart)
        render_chart(ledger.daily_spend(rows, now=now, days=days), path)
        env.ui.ok(f"Chart of daily spend written to {path}")


def _table(rep: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    from cloudtrain.ledger import money
    from cloudtrain.ui import color_ok

    span = "everything recorded" if rep.days is None else f"the last {rep.days:g} day(s)"
    if not rep.clusters:
        click.echo("No usage recorded." if rep.days is None
                   else f"No usage in the last {rep.days:g} day(s).")
        return
    table = Table(box=None, pad_edge=False)
    for col in ("CLUSTER", "PROVIDER", "REGION", "INSTANCE", "NODES", "SPOT", "HOURS",
                "$/NODE-H AT LAUNCH", "COST", "STATUS"):
        table.add_column(col, justify="right" if col in ("NODES", "HOURS", "COST") else "left")
    for c in rep.clusters:
        status = c.status if c.status == "running" or c.end_reason in (None, c.status) \
            else f"{c.status} ({c.end_reason})"
        status += "" if c.confirmed else " (unconfirmed)"
        price = "unknown" if c.price_at_launch is None else f"{c.price_at_launch:.4f}"
        table.add_row(c.cluster, c.provider, c.region or "-", c.instance_type or "-",
                      str(c.num_nodes), "yes" if c.use_spot else "no", _hours(c.hours), price,
                      money(c.cost), status)
    console = Console(no_color=not color_ok(sys.stdout), highlight=False,
                      color_system="auto" if color_ok(sys.stdout) else None, width=200)
    console.print(table)
    for c in rep.clusters:      # a scheduler's own accounting (Slurm: sacct)
        if c.gpu_hours is not None:
            click.echo(f"  {c.cluster}: {_hours(c.gpu_hours)} GPU-hour(s), "
                       f"{_hours(c.node_hours or 0.0)} node-hour(s) from sacct (Slurm job(s) "
                       f"{', '.join(c.jobs)}), cost {money(c.cost)}")
    click.echo("")
    for p, v in sorted(rep.by_provider.items()):
        click.echo(f"  {p:<12}{money(v)}")
    click.echo(f"Total for {span}: {money(rep.total_cost)} over {_hours(rep.total_hours)} "
               "cluster-hour(s)")
    for n in rep.notes:
        click.echo(f"note: {n}")


def _sweep_table(rows: list[list[str]], alone: bool) -> None:
    """The sweeps (header first): one row each; "No sweep recorded." when asked alone."""
    from rich.console import Console
    from rich.table import Table

    from cloudtrain.ui import color_ok

    if len(rows) == 1:
        if alone:
            click.echo("No sweep recorded.")
        return
    if not alone:
        click.echo("")
    table = Table(box=None, pad_edge=False)
    for col in rows[0]:
        table.add_column("SWEEP" if col == "name" else col.upper().replace("_", " "),
                         justify="left" if col in ("name", "cluster", "started_at", "as_of")
                         else "right")
    for row in rows[1:]:
        table.add_row(*(("$" + c) if h == "spent_usd" and c != "unknown" else c
                        for h, c in zip(rows[0], row)))
    Console(no_color=not color_ok(sys.stdout), highlight=False,
            color_system="auto" if color_ok(sys.stdout) else None, width=200).print(table)


def _hours(h: float) -> str:
    return f"{h:.2f}" if h >= 0.1 or h == 0 else f"{h:.4f}"


def _check_chart_deps() -> None:
    from cloudtrain.errors import UserError

    try:
        import matplotlib  # noqa: F401 - only whether matplotlib is installed
    except ImportError:
        raise UserError("--chart needs matplotlib, which is not installed.",
                        f"Install it with: {CHART_EXTRA}") from None


def render_chart(daily: dict[date, dict[str, float]], path: Path) -> dict[date, float]:
    """Stacked bars of spend per UTC day, one colour per provider, written to ``path`` (PNG).
    Returns the height of each day's stack as drawn (read back from the bars), so a test can
    hold the picture against the ledger."""
    _check_chart_deps()
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    days = sorted(daily)
    providers = sorted({p for v in daily.values() for p in v})
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.35 * len(days) + 3)), 4), dpi=100)
    try:
        xs = list(range(len(days)))
        bottom = [0.0] * len(days)
        drawn: dict[date, float] = {d: 0.0 for d in days}
        for p in providers:
            heights = [daily[d].get(p, 0.0) for d in days]
            bars = ax.bar(xs, heights, bottom=bottom, label=p, width=0.8)
            for i, patch in enumerate(bars.patches):
                drawn[days[i]] += float(patch.get_height())
            bottom = [b + h for b, h in zip(bottom, heights)]
        step = max(1, len(days) // 15)
        ax.set_xticks(xs[::step])
        ax.set_xticklabels([d.isoformat() for d in days][::step], rotation=45, ha="right")
        ax.set_ylabel("USD")
        ax.set_xlabel("day (UTC)")
        ax.set_title("cloudtrain: daily spend by provider")
        if providers:
            ax.legend(loc="upper left")
        else:
            ax.text(0.5, 0.5, "no spend recorded", ha="center", va="center",
                    transform=ax.transAxes)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return drawn


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(cost_report)
