"""``cloudtrain catalog refresh``: rebuild the user-local catalog (``$CLOUDTRAIN_HOME/catalog/``)
from the clouds' public price sources. The user-local catalog wins over the shipped snapshot.

Refresh updates the PRICES of the instance shapes the current catalog knows (GPU model and
count, memory, vCPUs and RAM stay as they are) and adds rows where a source prices a known
instance type in a region the catalog lacks (AWS, Azure). Providers not refreshed keep their
rows. A source that fails writes nothing; the message says what failed and that the previous
prices stay in use (exit 1).

Only the standard library is imported at module level: ``cloudtrain --help`` stays fast. The
command itself (its options and output) is in cloudtrain/commands/catalog.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from .model import CatalogInfo, Offer
    from .sources import SourceError, SourceResult
    from .sources.httpfetch import Http

PROVIDERS = ("aws", "azure", "gcp")
LABEL = {"aws": "AWS", "azure": "Azure", "gcp": "GCP"}


@dataclass
class ProviderStats:
    updated: int = 0
    changed: int = 0
    new: int = 0
    not_priced: int = 0
    new_regions: set[str] = field(default_factory=set)


@dataclass
class RefreshReport:
    path: Path
    written: bool
    refreshed: dict[str, ProviderStats] = field(default_factory=dict)
    failed: dict[str, SourceError] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    previous: CatalogInfo | None = None
    as_of: str = ""


# --- the current catalog -----------------------------------------------------------------------

def current_catalog(home: Path) -> tuple[list[Offer], CatalogInfo, tuple[str, ...]]:
    """The catalog in use now (the user-local one, else the shipped snapshot): its rows as
    stored (before the loader's corrections, which every load applies anyway, so that they
    are not baked in and rows the loader sets aside can still be priced), where it comes
    from, and the loader's warnings."""
    from . import store
    from .load import load_catalog

    cat = load_catalog(home)
    try:
        offers = store.read_offers(Path(cat.info.path) / store.OFFERS_FILE)
    except (OSError, ValueError):
        offers = list(cat.offers)
    return offers, cat.info, tuple(cat.warnings)


def describe_catalog(info: CatalogInfo) -> str:
    if info.kind == "snapshot":
        return f"the shipped snapshot from {info.as_of}"
    return f"your refreshed catalog from {info.as_of}"


# --- merging -----------------------------------------------------------------------------------

def merge(current: list[Offer], results: dict[str, SourceResult]
          ) -> tuple[list[Offer], dict[str, ProviderStats]]:
    """The current offers with the results' prices applied and their new offers added."""
    from .sources import offer_key

    stats = {p: ProviderStats() for p in results}
    out: list[Offer] = []
    keys = set()
    for o in current:
        res = results.get(o.provider)
        k = offer_key(o)
        keys.add((o.provider, k))
        if res is None:
            out.append(o)
            continue
        q = res.updates.get(k)
        if q is None or (q.price is None and q.spot_price is None):
            stats[o.provider].not_priced += 1
            out.append(o)
            continue
        n = replace(o, price=o.price if q.price is None else round(q.price, 6),
                    spot_price=o.spot_price if q.spot_price is None else round(q.spot_price, 6))
        stats[o.provider].updated += 1
        stats[o.provider].changed += (n.price, n.spot_price) != (o.price, o.spot_price)
        out.append(n)
    for p, res in results.items():
        for o in res.new_offers:
            k = offer_key(o)
            if (p, k) in keys:
                continue
            keys.add((p, k))
            out.append(replace(o, provider=p,
                               price=None if o.price is None else round(o.price, 6),
                               spot_price=None if o.spot_price is None else round(o.spot_price, 6)))
            stats[p].new += 1
            stats[p].new_regions.add(o.region)
    out.sort(key=lambda o: (o.provider, o.accelerator or "", o.instance_type, o.region,
                            o.accelerator_count))
    return out, stats


def _source_line(previous: CatalogInfo, results: dict[str, SourceResult], as_of: str,
                 providers_present: Iterable[str]) -> str:
    """One line: per provider, when and from where its prices come."""
    old: dict[str, str] = {}
    if previous.kind == "user":
        for seg in previous.source.split("; "):
            p, sep, _ = seg.partition(" ")
            if sep and p in PROVIDERS:
                old[p] = seg
    segs = []
    for p in sorted(set(providers_present) | set(results)):
        res = results.get(p)
        if res is not None:
            urls = list(dict.fromkeys(res.urls))
            files = [u for u in urls if u.endswith("/index.json")]
            if len(files) > 2:   # AWS: one price list per region
                first = urls.index(files[0])
                urls = [u for u in urls if u not in files]
                urls.insert(first, f"{len(files)} region price lists like {files[0]}")
            segs.append(f"{p} refreshed {as_of} from {' '.join(u for u in urls if u)}")
        elif p in old:
            segs.append(old[p])
        else:
            segs.append(f"{p} from {describe_catalog(previous)}")
    return "; ".join(segs)


# --- the refresh -------------------------------------------------------------------------------

def refresh(home: Path, providers: Sequence[str] = (), *, api_key: str | None = None,
            regions: Sequence[str] = (), http: Http | None = None,
            aws_client_factory: Callable[[str], Any] | None = None,
            progress: Callable[[str], None] | None = None,
            warn: Callable[[str], None] | None = None) -> RefreshReport:
    """Refresh ``providers`` (default: all; GCP only with an API key) into ``home/catalog``.

    ``aws_client_factory(region)`` makes the EC2 clients for spot prices (default: boto3's
    credential chain; without credentials the previous spot prices stay)."""
    from datetime import datetime, timezone

    from . import store
    from .model import CatalogInfo
    from .sources import SourceError
    from .sources.httpfetch import Http

    say = progress or (lambda m: None)
    warn = warn or say
    explicit = bool(providers)
    wanted = [p for p in PROVIDERS if not providers or p in providers]
    http = http or Http()
    offers, info, warnings = current_catalog(home)
    for w in warnings:
        warn(w)
    report = RefreshReport(path=home / "catalog", written=False, previous=info)
    if not (api_key or "").strip() and "gcp" in wanted:
        from ..errors import UserError

        if explicit:
            raise UserError("GCP prices come from the Cloud Billing Catalog API, which needs an "
                            "API key.", "Pass --api-key KEY or set CLOUDTRAIN_GCP_API_KEY (a key "
                            "from a project with the Cloud Billing API enabled).")
        wanted.remove("gcp")
        report.skipped["gcp"] = ("no API key (--api-key or CLOUDTRAIN_GCP_API_KEY); "
                                 "the GCP prices stay as they are")
    say(f"Refreshing {', '.join(LABEL[p] for p in wanted) or 'nothing'} "
        f"(the catalog in use is {describe_catalog(info)})")

    results: dict[str, SourceResult] = {}
    for p in wanted:
        mine = [o for o in offers if o.provider == p]
        try:
            results[p] = _fetch_one(p, mine, http, say, api_key=api_key or "", regions=regions,
                                    aws_client_factory=aws_client_factory)
        except SourceError as exc:
            report.failed[p] = exc
            say(f"{LABEL[p]}: failed: {exc.host}: {exc.reason}")
            continue
        for n in results[p].notes:
            report.notes.append(n)
            warn(n)

    if results:
        merged, report.refreshed = merge(offers, results)
        as_of = datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        present = sorted({o.provider for o in merged})
        folder = home / "catalog"
        store.write_offers(folder / store.OFFERS_FILE, merged)
        store.write_meta(folder, CatalogInfo(
            kind="user", path=str(folder), as_of=as_of,
            source=_source_line(info, results, as_of, present), providers=tuple(present)))
        report.written = True
        report.as_of = as_of
    return report


def _fetch_one(p: str, offers: list[Offer], http: Http, say: Callable[[str], None], *,
               api_key: str, regions: Sequence[str],
               aws_client_factory: Callable[[str], Any] | None) -> SourceResult:
    if p == "aws":
        from .sources import aws

        factory, why = aws_client_factory, ""
        if factory is None:
            factory, why = aws.default_client_factory(http.cfg.connect_timeout,
                                                      http.cfg.read_timeout)
        return aws.fetch(offers, http, say, regions=regions, client_factory=factory,
                         spot_unavailable=why)
    if p == "azure":
        from .sources import azure

        return azure.fetch(offers, http, say, regions=regions)
    from .sources import gcp

    return gcp.fetch(offers, http, say, api_key=api_key, regions=regions)


def failure_message(report: RefreshReport) -> tuple[str, str]:
    """(message, hint) for the sources that failed: one paragraph."""
    prev = report.previous
    assert prev is not None
    unreachable = {p: e for p, e in report.failed.items() if e.unreachable}
    other = {p: e for p, e in report.failed.items() if not e.unreachable}
    parts = []
    if unreachable:
        parts.append("could not reach " + _and([f"{e.host} ({e.reason})"
                                                for e in unreachable.values()]))
    if other:
        parts.append(_and([f"{e.host} failed ({e.reason})" for e in other.values()]))
    failed = _and([LABEL[p] for p in report.failed])
    if report.written:
        done = _and([LABEL[p] for p in report.refreshed])
        msg = (f"{'; '.join(parts)}: the {failed} prices in use are still those of "
               f"{describe_catalog(prev)} ({done} refreshed).")
    else:
        msg = f"{'; '.join(parts)}: the catalog in use is still {describe_catalog(prev)}."
    if unreachable and not other:
        hint = "Check your connection or proxy (HTTPS_PROXY), then run again."
    elif unreachable:
        hint = "Check your connection or proxy (HTTPS_PROXY) and the messages above, then run again."
    else:
        hint = "Run again later; if it keeps failing, the price source may have changed its format."
    return msg, hint


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def summary(report: RefreshReport) -> str:
    bits = []
    for p, s in report.refreshed.items():
        b = f"{LABEL[p]} {s.updated} offers priced ({s.changed} changed)"
        if s.new:
            b += f", {s.new} new in {len(s.new_regions)} region(s)"
        if s.not_priced:
            b += f", {s.not_priced} not in the source (previous prices kept)"
        bits.append(b)
    return "; ".join(bits)


def http_client(read_timeout: float | None = None) -> Http:
    """The HTTP client of a refresh: timeouts and retries from CLOUDTRAIN_HTTP_*, with
    ``read_timeout`` (seconds) instead of the environment's read timeout when given."""
    from .sources.httpfetch import Http, HttpConfig

    return Http(HttpConfig.from_env(read_timeout=read_timeout))
