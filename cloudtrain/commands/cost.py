"""``cloudtrain cost TASK``: ranked offers, estimates, memory fit."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from cloudtrain.commands.base import CONTEXT, guard, show_notes
from cloudtrain.commands.overrideopts import override_options, overrides_from

if TYPE_CHECKING:
    from cloudtrain.catalog.load import Catalog
    from cloudtrain.memfit import MemoryEstimate
    from cloudtrain.overrides import Change, Overrides
    from cloudtrain.ranking import PlanResult
    from cloudtrain.taskmodel import Task

TABLE_ROWS = 10


@dataclass(frozen=True)
class CostQuery:
    """What ``cloudtrain cost`` was asked: the task file and the options, as click parsed
    them (see the command's options for each)."""

    task_file: str
    hours: float | None = None
    as_json: bool = False
    top: int | None = None
    accelerators: str | None = None
    spot: bool | None = None
    model_params: str | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    strategy: str = "ddp"
    overrides: Overrides | None = None


@dataclass(frozen=True)
class Pick:
    """The offer 'up' would take: its index in the ranked offers (None: none), and why."""

    index: int | None
    note: str


@click.command(context_settings=CONTEXT)
@click.argument("task_file", type=click.Path(dir_okay=False))
@click.option("--hours", "hours", type=float, metavar="H",
              help="Hours to price (default: the task's max_hours, else 1).")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: one object, {\"offers\": [...], \"choice\": the "
                   "offer up would take or null, ...} (docs/cost.md). When nothing is "
                   "feasible it is still printed, with choice null, and the exit code is 2.")
@click.option("--top", "top", type=int, metavar="N",
              help=f"Show the N cheapest offers (default: {TABLE_ROWS} in the table, all in "
                   "--json; there, with --model-params, also the N cheapest that do not "
                   "fit).")
@click.option("--accelerators", "accelerators", metavar="NAME:COUNT",
              help="Price these GPUs instead of the task's, e.g. H100:8; any:8 lets memory "
                   "and price choose the model.")
@click.option("--spot/--on-demand", "spot", default=None,
              help="The market to price (default: the task's use_spot).")
@click.option("--model-params", "model_params", metavar="N",
              help="Parameters of the model (7e9, 7B, 350M): keep only offers whose GPUs "
                   "hold it.")
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16",
              show_default=True, help="Training precision (with --model-params).")
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw",
              show_default=True, help="Optimizer (with --model-params).")
@click.option("--strategy", type=click.Choice(["ddp", "fsdp"]), default="ddp",
              show_default=True,
              help="ddp: every GPU holds everything; fsdp: states sharded over every GPU.")
@override_options
@guard
def cost(task_file: str, **options: Any) -> None:
    """What TASK_FILE costs: the feasible offers cheapest first ($/h per node, $/h for the
    cluster, the total for H hours, the spot price and its saving), which one 'up' would
    pick, and why the other offers don't fit. Prices come from the catalog in use
    ('cloudtrain catalog info'); nothing is created.

    \b
    With --model-params, only offers whose GPUs hold the model are kept. Per GPU:
      needed = params x (weights + gradients + optimizer bytes) / shards x 1.2 + 1 GiB
      weights    4 B (fp32), or 2 + 4 B (bf16/fp16: compute copy + fp32 master)
      gradients  4 B (fp32), or 2 B (bf16/fp16)
      optimizer  8 B (adamw: two fp32 moments), or 4 B (sgd: momentum)
      shards     every GPU of the cluster for fsdp, 1 for ddp
      x 1.2      20 % activation allowance; + 1 GiB CUDA context and workspace
    It fits when needed <= 90 % of the GPU's memory. See docs/cost.md.

    \b
    --json prints one object: "offers" (each with provider, instance_type, accelerator,
    accelerator_count, gpu_memory_gib, vcpus, memory_gib, region, price_hourly_usd,
    spot_price_hourly_usd, nodes, cluster_hourly_usd, total_usd; with --model-params also
    "fits", and "reason" for the offers that do not fit, listed after the feasible ones)
    and "choice" (the offer up would take; null when there is none).

    --gpus, --num-nodes, --use-spot/--no-use-spot, --provider and --region apply over the
    task file (as for up and launch) and are listed above the table ("overrides" in --json).
    --env does not change a price: it is launch's.

    Exit codes: 0; 2 when nothing is feasible (with --json the object is printed to
    stdout all the same, "choice" null) or the input is bad.
    """
    ov = overrides_from(options)
    _run(CostQuery(task_file, **options, overrides=ov))


def load_cost_task(task_file: str, accelerators: str | None) -> Task:
    """The task ``cost`` prices (no overrides), e.g. for bench/bench_cost.py."""
    return load_overridden(task_file, accelerators)[0]


def load_overridden(task_file: str, accelerators: str | None,
                    ov: Overrides | None = None) -> tuple[Task, list[Change]]:
    """The task ``cost`` prices, with the command line's overrides, and what they changed."""
    from cloudtrain import overrides
    from cloudtrain.ranking import CLOUDS

    # resources.<provider> checked, the command line's overrides applied first
    task, changes = overrides.load(task_file, ov or overrides.Overrides(), known_providers=CLOUDS)
    show_notes(task)
    if accelerators is not None:
        from pydantic import ValidationError

        from cloudtrain.errors import UserError
        from cloudtrain.taskmodel import Accelerators, parse_accelerators

        try:
            acc = Accelerators.model_validate(parse_accelerators(accelerators))
        except (ValueError, ValidationError) as exc:
            msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise UserError(f"--accelerators '{accelerators}': {msg.removeprefix('Value error, ')}.",
                            "Write NAME:COUNT, e.g. A100:8 or any:8.") from None
        res = task.resources
        update: dict[str, Any] = {"accelerators": acc}
        if res.provider == "local" and res.accelerators is None and not res.instance_type:
            update["provider"] = None     # local was only the default: let the planner choose
        task = task.model_copy(update={"resources": res.model_copy(update=update)})
    return task, changes


def _one_of(q: CostQuery) -> None:
    """--accelerators/--gpus and --spot/--use-spot say the same: one of each pair."""
    from cloudtrain.errors import UserError

    ov = q.overrides
    if ov is not None and ov.gpus is not None and q.accelerators is not None:
        raise UserError("--gpus and --accelerators both set the GPUs.", "Give one of them.")
    if ov is not None and ov.use_spot is not None and q.spot is not None:
        raise UserError("--use-spot/--no-use-spot and --spot/--on-demand both set the market.",
                        "Give one of them.")


def _check_hours(h: float) -> float:
    from cloudtrain.errors import UserError

    if not 0 < h < float("inf"):
        raise UserError(f"--hours must be a number of hours above 0 (got {h:g}).",
                        "e.g. --hours 12")
    return h


def _run(q: CostQuery) -> None:
    from cloudtrain.errors import UserError
    from cloudtrain.memfit import MemoryEstimate, parse_params

    as_json, top = q.as_json, q.top
    if top is not None and top < 1:
        raise UserError(f"--top must be 1 or more (got {top}).", "e.g. --top 5")
    if q.hours is not None:
        _check_hours(q.hours)     # bad input is refused before the task is read
    fit = None
    if q.model_params is not None:
        fit = MemoryEstimate(parse_params(q.model_params), q.precision, q.optimizer, q.strategy)
    _one_of(q)
    task, changes = load_overridden(q.task_file, q.accelerators, q.overrides)
    if changes and not as_json:
        for c in changes:
            click.echo(f"override: {c.words()}")
    h = _check_hours(q.hours if q.hours is not None else (task.max_hours or 1.0))
    res = task.resources
    if q.spot is not None and q.spot != res.use_spot:
        task = task.model_copy(update={"resources": res.model_copy(update={"use_spot": q.spot})})
        res = task.resources

    from cloudtrain.ranking import CLOUDS

    if res.provider is not None and res.provider not in CLOUDS:
        _no_catalog(task, h, fit, as_json, [c.as_json() for c in changes])
        return

    from cloudtrain.catalog.load import load_catalog
    from cloudtrain.paths import home
    from cloudtrain.planner import availability
    from cloudtrain.ranking import rank_task

    from cloudtrain.provider.fabric import fast_only

    catalog = load_catalog(home())
    result = rank_task(task, fast_only(res.network, catalog.offers), fit=fit)
    avail = availability(set(CLOUDS) | {o.provider for o in catalog.offers})
    if not result.ranked:
        err = result.error()
        if as_json:
            note = f"nothing is feasible: {result.summary()}"
            doc = cost_document(task, result, h, Pick(None, note), avail, catalog, fit, top)
            doc["error"] = err.message
            doc["overrides"] = [c.as_json() for c in changes]
            click.echo(json.dumps(doc, indent=2))
        raise err
    doc = cost_document(task, result, h, _up_pick(task, result, avail), avail, catalog, fit, top)
    doc["overrides"] = [c.as_json() for c in changes]
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    _print(doc, result, h, top)
    from cloudtrain.check import warning

    if (line := warning(res.provider)) is not None:
        click.echo(f"warning: {line}", err=True)
    for w in catalog.warnings:
        click.echo(f"warning: {w}", err=True)


def _up_pick(task: Task, result: PlanResult, avail: dict[str, str | None]) -> Pick:
    """The offer in ``result.ranked`` 'up' would take, and a line saying why."""
    if task.resources.provider is not None:
        return Pick(0, f"the task names {task.resources.provider}: up takes its cheapest offer")
    usable = sorted(p for p, why in avail.items() if why is None)
    for i, r in enumerate(result.ranked):
        if avail.get(r.offer.provider, "unknown") is None:
            return Pick(i, f"the task names no provider: up takes the cheapest offer on a "
                           f"cloud installed with credentials ({', '.join(usable)})")
    reasons = "; ".join(f"{p}: {why}" for p, why in sorted(avail.items()) if why)
    if usable:
        return Pick(None, f"up would pick none: no feasible offer on {', '.join(usable)}, the "
                          f"clouds installed with credentials ({reasons})")
    return Pick(None, f"up would pick none: no cloud is usable here ({reasons})")


def cost_document(task: Task, result: PlanResult, hours: float, up_pick: Pick,
                  avail: dict[str, str | None], catalog: Catalog, fit: MemoryEstimate | None,
                  top: int | None) -> dict[str, Any]:
    """``cost --json``. Field names of "offers" and "choice" are a contract (docs/cost.md)."""
    from cloudtrain.provider.fabric import fabric_of
    from cloudtrain.ranking import priced_json

    pick = up_pick.index

    def usable(provider: str) -> bool:
        return task.resources.provider is not None or avail.get(provider, "unknown") is None

    def entry(i: int) -> dict[str, Any]:
        r = result.ranked[i]
        d: dict[str, Any] = {"rank": i + 1, **r.to_dict(hours)}
        fab = fabric_of(r.offer.provider, r.offer.instance_type)
        d["network"] = fab.to_dict() if fab else None   # the fast network, None: plain
        if fit is not None:
            d["fits"] = True
            d["needed_gib"] = None if r.fit is None else round(r.fit.needed_gib, 2)
        d["up_would_pick"] = i == pick
        d["usable_by_up"] = usable(r.offer.provider)
        return d

    n = len(result.ranked) if top is None else min(top, len(result.ranked))
    offers = [entry(i) for i in range(n)]
    if fit is not None:
        # Offers that pass every other check up to memory but do not hold the model: listed
        # after the feasible ones, with why, so that a script sees what was close.
        spot = task.resources.use_spot
        misfits = []
        for rej in result.rejected:
            if rej.constraint != "memory":
                continue
            for o in rej.offers:
                d = {"rank": None, **priced_json(o, task.num_nodes, spot, hours), "fits": False,
                     "reason": rej.reason,
                     "needed_gib": round(fit.breakdown(o.accelerator_count * task.num_nodes)
                                         .needed_gib, 2),
                     "up_would_pick": False, "usable_by_up": usable(o.provider)}
                misfits.append(d)
        misfits.sort(key=lambda d: (d["cluster_hourly_usd"] is None, d["cluster_hourly_usd"] or 0,
                                    d["provider"], d["region"], d["instance_type"]))
        offers += misfits if top is None else misfits[:top]
    memory = None
    if fit is not None:
        if result.ranked:
            best = result.ranked[pick if pick is not None else 0]
            memory = best.fit.to_dict() if best.fit else None
        else:
            acc = task.resources.accelerators
            memory = fit.breakdown((acc.count if acc else 1) * task.num_nodes).to_dict()
    age = catalog.age_days()
    return {
        "task": task.name, "request": result.want, "num_nodes": task.num_nodes,
        "market": "spot" if task.resources.use_spot else "on-demand",
        "max_hourly_cost": task.resources.max_hourly_cost, "hours": hours,
        "choice": None if pick is None else entry(pick),
        "choice_note": up_pick.note,
        "feasible": len(result.ranked),
        "offers": offers,
        "rejected": [r.to_dict() for r in result.rejected],
        "suggestions": list(result.suggestions),
        "providers": {p: {"usable": why is None, "why_not": why} for p, why in avail.items()},
        "catalog": {"kind": catalog.info.kind, "as_of": catalog.info.as_of,
                    "age_days": None if age is None else round(age, 1),
                    "source": catalog.info.source, "path": catalog.info.path,
                    "warnings": list(catalog.warnings)},
        "memory": memory,
    }


def _net(n: dict[str, Any] | None) -> str:
    """The NETWORK cell: 'efa 4x100G', or 'plain'."""
    return f"{n['fabric']} {n['links']}x{n['gbps_per_link']}G" if n else "plain"


def _money(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}"


def _print(doc: dict[str, Any], result: PlanResult, hours: float, top: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from cloudtrain.ui import color_ok

    n = top or TABLE_ROWS
    out = click.echo
    market = doc["market"]
    out(f"{result.want}: {doc['feasible']} feasible offer(s), cheapest first, "
        f"priced {market} for {hours:g} h")
    table = Table(box=None, pad_edge=False)
    hcol = f"TOTAL {hours:g}H"
    other = "ON-DEMAND $/H CLUSTER" if market == "spot" else "SPOT $/H CLUSTER"
    for col in ("", "#", "PROVIDER", "REGION", "INSTANCE", "GPUS", "NETWORK", "$/H NODE",
                "$/H CLUSTER", hcol, other, "SPOT SAVES"):
        right = "$" in col or col in (hcol, "#", "SPOT SAVES")
        table.add_column(col, justify="right" if right else "left")
    feasible = [d for d in doc["offers"] if d["rank"] is not None]
    for d, r in zip(feasible[:n], result.ranked):
        alt = r.alternative_per_node
        saving = d["spot_saving_pct"]
        table.add_row("*" if d["up_would_pick"] else "", str(d["rank"]), d["provider"],
                      d["region"], d["instance_type"], r.gpus(), _net(d["network"]),
                      _money(d["node_hourly_usd"]),
                      _money(d["cluster_hourly_usd"]), _money(d["total_usd"]),
                      "-" if alt is None else _money(alt * r.num_nodes),
                      "-" if saving is None else f"{saving:.0f}%")
    color = color_ok(sys.stdout)
    Console(no_color=not color, highlight=False, color_system="auto" if color else None,
            width=200).print(table)
    if len(result.ranked) > n:
        out(f"  ... and {len(result.ranked) - n} more (--top N, or --json for all)")
    pick = doc["choice"]
    if pick is not None:
        out(f"up would pick (*): {pick['provider']} {pick['instance_type']} in {pick['region']}, "
            f"${pick['cluster_hourly_usd']:,.2f}/h for {pick['nodes']} node(s), "
            f"${pick['total_usd']:,.2f} for {hours:g} h ({doc['choice_note']})")
        if pick["spot_price_hourly_usd"] is not None and market == "on-demand":
            sp = pick["spot_price_hourly_usd"] * pick["nodes"]
            out(f"  as spot (use_spot: true): ${sp:,.2f}/h, ${sp * hours:,.2f} for {hours:g} h, "
                f"saving {pick['spot_saving_pct']:.0f}% (spot nodes can be reclaimed)")
    else:
        out(doc["choice_note"])
    if doc["memory"] is not None:
        idx = (pick["rank"] - 1) if pick is not None else 0
        b = result.ranked[idx].fit
        if b is not None:
            out(f"Memory per GPU ({result.memory.describe() if result.memory else ''}):")
            for line in b.lines():
                out(f"  {line}")
    if result.rejected:
        out("Not feasible:")
        for rej in sorted(result.rejected, key=lambda r: (r.constraint == "gpu", -r.count)):
            out(f"  {rej}")
    cat = doc["catalog"]
    days = cat["age_days"]
    from cloudtrain.commands.catalog import describe_age

    out(f"Prices: {cat['kind']} catalog as of {cat['as_of']}, {describe_age(days)} ({cat['path']})")


def _no_catalog(task: Task, hours: float, fit: MemoryEstimate | None, as_json: bool,
                overrides: list[dict[str, Any]]) -> None:
    """local / ssh (and providers the catalog has no prices for)."""
    from cloudtrain.provider.options import provider_options

    name = str(task.resources.provider)
    price: float | None = None
    if name in ("local", "ssh"):
        opts = provider_options(task)
        price = float(getattr(opts, "price_per_hour", 0.0) or 0.0)
        note = (f"provider {name} runs on machines you already have: "
                + ("no cloud price applies" if not price else
                   f"priced at resources.{name}.price_per_hour ${price:g}/h per node"))
    else:
        note = f"the catalog has no prices for provider {name}"
    memory = fit.breakdown(1).to_dict() if fit is not None else None
    cluster = None if price is None else price * task.num_nodes
    acc = task.resources.accelerators
    choice = {
        "provider": name, "instance_type": task.resources.instance_type,
        "accelerator": acc.name if acc else None,
        "accelerator_count": float(acc.count) if acc else None, "gpu_memory_gib": None,
        "vcpus": None, "memory_gib": None, "region": task.resources.region,
        "price_hourly_usd": price, "spot_price_hourly_usd": None, "nodes": task.num_nodes,
        "market": "on-demand", "node_hourly_usd": price, "cluster_hourly_usd": cluster,
        "total_usd": None if cluster is None else round(cluster * hours, 2),
    }
    doc: dict[str, Any] = {
        "task": task.name, "num_nodes": task.num_nodes, "hours": hours,
        "choice": choice, "choice_note": note, "feasible": 1, "offers": [], "rejected": [],
        "suggestions": [], "providers": {}, "catalog": None, "memory": memory,
        "overrides": overrides,
    }
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    if cluster is None:
        click.echo(f"{name}: {note}.")
    else:
        click.echo(f"{name}: ${price:.2f}/h per node, ${cluster:.2f}/h for {task.num_nodes} "
                   f"node(s), ${cluster * hours:.2f} for {hours:g} h: {note}.")
    if fit is not None:
        click.echo(f"Memory per GPU if unsharded ({fit.describe()}), not checked against "
                   f"{name}'s GPUs:")
        for line in fit.breakdown(1).lines():
            click.echo(f"  {line}")


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(cost)
