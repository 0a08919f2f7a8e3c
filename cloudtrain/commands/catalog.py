"""``cloudtrain catalog info|refresh`` and ``cloudtrain gpus``.

``catalog_group`` is the ``catalog`` command group; ``catalog refresh`` is the click side of
cloudtrain/catalog/refresh.py. Only click is imported here at module level
(``cloudtrain --help`` stays fast).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from cloudtrain.commands.base import CONTEXT, guard

# cloudtrain.catalog.refresh.PROVIDERS, spelled out: importing that module here cost every
# command (--help and status too) its import (tests/unit/test_command_imports.py keeps them equal).
REFRESH_PROVIDERS = ("aws", "azure", "gcp")

if TYPE_CHECKING:
    from cloudtrain.catalog.load import Catalog

PROVIDERS = ("aws", "gcp", "azure")


@click.group(name="catalog", context_settings=CONTEXT)
def catalog_group() -> None:
    """The GPU offer catalog: which one is in use, how old it is, refreshing it."""


@catalog_group.command(name="info", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@guard
def catalog_info(as_json: bool) -> None:
    """Which catalog is in use (the snapshot shipped with cloudtrain, or the user-local one
    that 'catalog refresh' writes), how old it is, where it comes from and what the loader
    corrected."""
    cat = _catalog()
    age = cat.age_days()
    per = cat.per_provider()
    if as_json:
        _warn(cat)
        click.echo(json.dumps({
            "kind": cat.info.kind, "path": cat.info.path, "as_of": cat.info.as_of,
            "age_days": None if age is None else round(age, 2), "as_of_note": cat.note or None,
            "source": cat.info.source, "providers": list(cat.info.providers),
            "offers": len(cat.offers), "offers_per_provider": per,
            "corrections": list(cat.info.corrections), "warnings": list(cat.warnings),
        }, indent=2))
        return
    _warn(cat)
    kind = {"snapshot": "snapshot (shipped with cloudtrain)",
            "user": "user-local (written by 'cloudtrain catalog refresh')"}.get(cat.info.kind,
                                                                              cat.info.kind)
    rows = [("catalog", kind), ("path", cat.info.path),
            ("as of", f"{cat.info.as_of} ({describe_age(age)})")]
    if cat.note:
        rows.append(("note", cat.note))
    rows += [("source", cat.info.source),
             ("offers", ", ".join(f"{p} {n}" for p, n in per.items())
              + f" ({len(cat.offers)} in all)")]
    for k, v in rows:
        click.echo(f"{k + ':':<13}{v}")
    if cat.info.corrections:
        click.echo(f"corrections: {len(cat.info.corrections)} applied on load "
                   "(overrides.yaml, then sanity rules)")
        for line in cat.info.corrections:
            click.echo(f"  - {line}")
    else:
        click.echo("corrections: none")


def describe_age(days: float | None) -> str:
    if days is None:
        return "age unknown"
    if days < 1:
        return "less than a day old"
    return f"{days:.0f} day{'s' if round(days) != 1 else ''} old"


def _catalog() -> Catalog:
    from cloudtrain.catalog.load import load_catalog
    from cloudtrain.paths import home

    return load_catalog(home())


def _warn(cat: Catalog) -> None:
    if cat.warnings:
        from cloudtrain.ui import UI

        ui = UI()
        for w in cat.warnings:
            ui.warn(w)


def _parse_gpu(spec: str, cat: Catalog) -> tuple[str, float | None]:
    from cloudtrain.catalog.gpus import canonical_gpu, suggest_gpu
    from cloudtrain.errors import UserError

    name, sep, count_text = spec.partition(":")
    name = name.strip()
    count = None
    if sep:
        try:
            count = float(count_text)
        except ValueError:
            count = None
        if count is None or not count > 0 or count != count:
            raise UserError(f"'{spec}': the GPU count must be a positive number.",
                            "Write NAME or NAME:COUNT, e.g. A100:8.")
    known = cat.accelerators()
    canon = canonical_gpu(name) if name else None
    if canon is None:
        lowered = {k.casefold(): k for k in known}
        canon = lowered.get(name.casefold())
    if canon is None:
        from cloudtrain.ranking import count_spelling

        spelled = count_spelling(name) if not sep else None
        close = suggest_gpu(name, known) if name else None
        hint = (f"Did you mean '{spelled}' (NAME:COUNT)? " if spelled else
                f"Did you mean '{close}'? " if close else "")
        raise UserError(f"Unknown GPU '{name}'.",
                        hint + "Known GPUs: " + ", ".join(known) + ".")
    return canon, count


def _num(v: float | None, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _table(columns: tuple[str, ...], rows: Sequence[tuple[str, ...]],
           right: tuple[int, ...] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    from cloudtrain.ui import color_ok

    table = Table(box=None, pad_edge=False)
    for i, col in enumerate(columns):
        table.add_column(col, justify="right" if i in right else "left", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    ok = color_ok(sys.stdout)
    Console(no_color=not ok, highlight=False, color_system="auto" if ok else None,
            width=200).print(table)


def _footer(cat: Catalog, shown: int, total: int, offers: int) -> None:
    """'N rows (of T; --all ...)', how many offers they fold ('+N': more regions), the prices'
    age."""
    age = cat.age_days()
    where = "snapshot shipped with cloudtrain" if cat.info.kind == "snapshot" else \
        "user-local catalog"
    msg = f"{shown} offer{'s' if shown != 1 else ''}"
    if total > shown:
        msg += f" (of {total}; --all for every one)"
    if offers > total:
        msg += (f"; {offers} with their regions: one row for an offer sold at the same price "
                "in several regions ('+N': N more regions; spot prices from-to; --json lists "
                "each)")
    msg += (f". Prices: {where}, as of {cat.info.as_of} ({describe_age(age)}); "
            "see 'cloudtrain catalog info'.")
    click.echo(msg, err=True)


def _summary(cat: Catalog, provider: str | None, region: str | None, spot: bool,
             as_json: bool, fractional: bool = True) -> None:
    """No GPU named: one line per GPU model, cheapest per GPU first (``fractional``: slices
    of a GPU per node count too)."""
    from cloudtrain.catalog.rows import hidden_line, split_fractional

    models: dict[str, dict[str, Any]] = {}
    offers = [o for o in cat.offers if o.accelerator and not (provider and o.provider != provider)
              and not (region and o.region.casefold() != region.casefold())]
    offers, hidden = (offers, 0) if fractional else split_fractional(offers)
    for o in offers:
        if not o.accelerator:
            continue
        m = models.setdefault(o.accelerator, {"counts": set(), "providers": set(), "mem": set(),
                                              "od": None, "spot": None})
        m["counts"].add(o.accelerator_count)
        m["providers"].add(o.provider)
        if o.gpu_memory_gib is not None:
            m["mem"].add(o.gpu_memory_gib / min(o.accelerator_count, 1.0))
        for key, p in (("od", o.price), ("spot", o.spot_price)):
            if p is not None and o.accelerator_count:
                per = p / o.accelerator_count
                m[key] = per if m[key] is None else min(m[key], per)
    order = sorted(models, key=lambda k: (models[k]["spot" if spot else "od"] is None,
                                          models[k]["spot" if spot else "od"] or 0, k))
    if as_json:
        click.echo(json.dumps([{
            "accelerator": k, "gpu_memory_gib": sorted(models[k]["mem"]),
            "counts": sorted(models[k]["counts"]), "providers": sorted(models[k]["providers"]),
            "min_price_per_gpu": models[k]["od"], "min_spot_price_per_gpu": models[k]["spot"],
        } for k in order], indent=2))
        return
    if not order:
        click.echo("No GPU offers match.")
        return
    rows = []
    for k in order:
        m = models[k]
        mem = sorted(round(v, 1) for v in m["mem"])
        rows.append((k, "-" if not mem else f"{mem[0]:g}" if mem[0] == mem[-1]
                     else f"{mem[0]:g}-{mem[-1]:g}",
                     ",".join(f"{c:g}" for c in sorted(m["counts"])),
                     ",".join(sorted(m["providers"])), _num(m["od"], "{:.2f}"),
                     _num(m["spot"], "{:.2f}")))
    _table(("GPU", "MEM/GPU (GiB)", "GPUS/NODE", "PROVIDERS", "FROM $/GPU-H", "SPOT FROM $/GPU-H"),
           rows, right=(1, 4, 5))
    if hidden:
        click.echo(hidden_line(hidden), err=True)
    click.echo("Offers for one model: cloudtrain gpus NAME[:COUNT] (e.g. cloudtrain gpus A100:8).",
               err=True)


@click.command(name="gpus", context_settings=CONTEXT)
@click.argument("gpu", metavar="[NAME[:COUNT]]", required=False)
@click.option("--provider", type=click.Choice(PROVIDERS, case_sensitive=False),
              help="Only this cloud.")
@click.option("--region", help="Only this region.")
@click.option("--spot", is_flag=True,
              help="Sort by the spot price (offers without one are left out).")
@click.option("-n", "--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Show at most this many offers (the table; --json lists all).")
@click.option("--all", "show_all", is_flag=True, help="No limit.")
@click.option("--fractional", is_flag=True,
              help="Also offers with a fraction of a GPU per node (shared/vGPU slices such as "
                   "0.125 of an L4), hidden from the tables otherwise (--json lists them).")
@click.option("--models", "models", is_flag=True,
              help="One row per GPU model (what the table shows without NAME), also in --json.")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: a list of every matching offer (all of them, no "
                   "limit), each with provider, instance_type, accelerator, accelerator_count, "
                   "gpu_memory_gib (per GPU), vcpus, memory_gib, region, price_hourly_usd and "
                   "spot_price_hourly_usd (USD per node-hour; null: not sold so).")
@guard
def gpus(gpu: str | None, **options: Any) -> None:
    """GPU offers from the catalog, cheapest first (per node, on-demand; --spot: spot).

    \b
    cloudtrain gpus                      every GPU model, cheapest per GPU first
    cloudtrain gpus A100:8 --provider aws
    cloudtrain gpus h100 --region us-east-1 --spot --json
    cloudtrain gpus --json               every GPU offer of the catalog

    NAME takes aliases and any case (a100-40gb, H100-SXM). A query that matches nothing prints
    so (--json: []) and exits 0; an unknown GPU name exits 2. The tables leave out slices of a
    GPU (--fractional shows them) and fold an offer sold at the same price in several regions
    into one row ('us-east1 +5': 5 more regions; --json lists each offer)."""
    from cloudtrain.catalog.model import offer_json

    cat = _catalog()
    _warn(cat)
    provider = options["provider"].lower() if options["provider"] else None
    region, spot, as_json = options["region"], options["spot"], options["as_json"]
    if options["models"] or (gpu is None and not as_json):
        if gpu is not None:
            from cloudtrain.errors import UserError

            raise UserError("--models lists every GPU model: it takes no NAME.",
                            "e.g. cloudtrain gpus --models --json")
        _summary(cat, provider, region, spot, as_json, options["fractional"] or as_json)
        return
    if gpu is None:
        offers = [o for o in cat.find(None, None, provider=provider, region=region, spot=spot)
                  if o.accelerator]
    else:
        name, count = _parse_gpu(gpu, cat)
        offers = cat.find(name, count, provider=provider, region=region, spot=spot)
    if as_json:
        click.echo(json.dumps([offer_json(o) for o in offers], indent=2))
        return
    nothing = _no_offers(cat, name, count, provider, region, spot)
    _shown(cat, offers, nothing, options["fractional"] or (
        count is not None and not float(count).is_integer()),
        None if options["show_all"] else options["limit"])


def _shown(cat: Catalog, offers: list[Any], nothing: str, fractional: bool,
           limit: int | None) -> None:
    """The offers' table: slices of a GPU left out unless ``fractional`` (one line says how
    many), an offer in several regions at one price folded into one row; ``nothing``: what
    to say when no offer is left."""
    from cloudtrain.catalog.rows import fold, hidden_line, split_fractional

    offers, hidden = (offers, 0) if fractional else split_fractional(offers)
    rows = fold(offers)
    if not rows:
        click.echo(nothing)
    else:
        _offers_table(cat, rows[:limit], len(rows), len(offers))
    if hidden:
        click.echo(hidden_line(hidden), err=True)


def _offers_table(cat: Catalog, shown: list[Any], total: int, offers: int) -> None:
    from cloudtrain.catalog.rows import spot_cell

    rows = []
    for row in shown:
        o, mem = row.offer, row.offer.gpu_memory_gib
        rows.append((o.provider, o.instance_type, f"{o.accelerator}:{o.accelerator_count:g}",
                     _num(mem), _num(o.vcpus), _num(o.memory_gib), row.region_cell,
                     _num(o.price, "{:.2f}"), spot_cell(row)))
    _table(("PROVIDER", "INSTANCE", "GPU", "MEM/GPU (GiB)", "VCPUS", "RAM (GiB)", "REGION",
            "$/H", "SPOT $/H"), rows, right=(3, 4, 5, 7, 8))
    _footer(cat, len(shown), total, offers)


def _no_offers(cat: Catalog, name: str, count: float | None, provider: str | None,
               region: str | None, spot: bool) -> str:
    what = name + (f":{count:g}" if count is not None else "")
    where = "".join([f" on {provider}" if provider else "", f" in {region}" if region else ""])
    msg = f"No {'spot ' if spot else ''}offers for {what}{where} in the catalog."
    hints = []
    if region and region.casefold() not in {r.casefold() for r in cat.regions(provider)}:
        from difflib import get_close_matches

        close = get_close_matches(region, cat.regions(provider), n=1)
        hints.append(f"no region '{region}' is in the catalog"
                     + (f" (did you mean '{close[0]}'?)" if close else ""))
    counts = sorted({o.accelerator_count for o in cat.offers if o.accelerator == name
                     and (provider is None or o.provider == provider)})
    if count is not None and counts and count not in counts:
        hints.append(f"{name} comes with {', '.join(f'{c:g}' for c in counts)} per node"
                     + (f" on {provider}" if provider else ""))
    if spot and cat.find(name, count, provider=provider, region=region):
        hints.append("there are on-demand offers (drop --spot)")
    return msg + ("" if not hints else " Note: " + "; ".join(hints) + ".")


# --- catalog refresh ---------------------------------------------------------------------------

@click.command("refresh", context_settings=CONTEXT)
@click.option("--provider", "providers", multiple=True, type=click.Choice(REFRESH_PROVIDERS),
              help="Only this provider (repeatable; default: all, GCP only with an API key).")
@click.option("--region", "regions", multiple=True, metavar="REGION",
              help="Only this region (repeatable; default: every region the sources price).")
@click.option("--api-key", envvar="CLOUDTRAIN_GCP_API_KEY", show_envvar=True, metavar="KEY",
              help="Google API key for the Cloud Billing Catalog API (GCP prices).")
@click.option("--timeout", type=click.FloatRange(min=1), metavar="SECONDS",
              help="Read timeout per request (default 60; connecting: 10).")
@click.option("-q", "--quiet", is_flag=True, help="No progress; only warnings and errors.")
@guard
def refresh_command(providers: tuple[str, ...], regions: tuple[str, ...], api_key: str | None,
                    timeout: float | None, quiet: bool) -> None:
    """Rebuild your local catalog from the clouds' public price lists: AWS (EC2 bulk price
    list; spot through the EC2 API, with credentials), Azure (Retail Prices API) and GCP
    (Cloud Billing Catalog API, with an API key).

    Prices of the instance shapes the catalog knows are updated, and known instance types
    priced in new regions are added. The result is written to $CLOUDTRAIN_HOME/catalog/ and
    is used instead of the shipped snapshot. AWS downloads a large price list per region:
    use --region to limit it."""
    from cloudtrain.catalog.refresh import LABEL, failure_message, http_client, refresh, summary
    from cloudtrain.errors import ProviderError
    from cloudtrain.paths import home
    from cloudtrain.ui import UI

    ui = UI(quiet=quiet)
    report = refresh(home(), providers, api_key=api_key, regions=regions,
                     http=http_client(timeout),
                     progress=ui.step, warn=ui.warn)
    for p, why in report.skipped.items():
        ui.warn(f"{LABEL[p]} skipped: {why}")
    if report.written:
        ui.ok(f"Catalog refreshed: {summary(report)}. Written to {report.path}; it is now used "
              "instead of the shipped snapshot.")
    if report.failed:
        msg, hint = failure_message(report)
        raise ProviderError(msg, hint)


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    catalog_group.add_command(refresh_command)
    cli.add_command(catalog_group)
    cli.add_command(gpus)
