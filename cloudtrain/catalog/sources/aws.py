"""AWS prices: on-demand from the public EC2 bulk price list, spot from
``DescribeSpotPriceHistory``.

On-demand. ``<base>/offers/v1.0/aws/AmazonEC2/current/region_index.json`` lists the regions,
each with a ``currentVersionUrl`` (a path on the same host) to that region's price list, a JSON
document of hundreds of megabytes::

    {"formatVersion": ..., "products": {SKU: {"productFamily": "Compute Instance",
                                              "attributes": {"instanceType": ..., ...}}, ...},
     "terms": {"OnDemand": {SKU: {TERM: {"priceDimensions": {RATE: {"unit": "Hrs",
                                                  "pricePerUnit": {"USD": "32.77"}}}}}},
               "Reserved": {...}}}

Each file is streamed to a temporary file and read once, one product or term at a time
(:class:`JsonStream`), so memory stays small. A product counts when it is a Linux, shared
tenancy, no pre-installed software, "Used" capacity, no-license row in that region for an
instance type the catalog knows; its price is the hourly on-demand price.

Spot. Per region, an EC2 client from the injected ``client_factory(region)`` pages through
``describe_spot_price_history`` (Linux/UNIX, the catalog's instance types, StartTime now: the
price in force in each zone); the region's spot price is the lowest over its zones. Without
boto3 or credentials the previous spot prices stay, and the result says so.

``CLOUDTRAIN_AWS_PRICING_URL`` replaces ``https://pricing.us-east-1.amazonaws.com`` (a mirror, or
a test server).
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
from dataclasses import replace
from datetime import datetime, timezone
from typing import IO, Any, Callable, Iterable, Iterator

from ..model import Offer
from . import Progress, Quote, SourceError, SourceResult, noop, offer_key
from .httpfetch import Http

DEFAULT_BASE = "https://pricing.us-east-1.amazonaws.com"
INDEX_PATH = "/offers/v1.0/aws/AmazonEC2/current/region_index.json"
ENV_BASE = "CLOUDTRAIN_AWS_PRICING_URL"
# Partitions an ordinary account cannot use (GovCloud, China, isolated regions).
_OTHER_PARTITIONS = ("us-gov-", "cn-", "us-iso", "eu-isoe-", "eusc-")

ClientFactory = Callable[[str], Any]


def base_url() -> str:
    return (os.environ.get(ENV_BASE) or DEFAULT_BASE).rstrip("/")


# --- a streaming reader for one big JSON document ---------------------------------------------

class JsonStream:
    """Walks a JSON document read from a text stream without holding it all: ``members()``
    iterates an object's keys (the caller then reads each value with ``value()``, ``skip()``,
    or ``members()`` again); ``value()`` decodes one (small) value."""

    _WS = re.compile(r"[ \t\n\r]*")
    MAX_VALUE = 64 << 20

    def __init__(self, f: IO[str], chunk: int = 1 << 20) -> None:
        self._f = f
        self._chunk = chunk
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._dec = json.JSONDecoder()

    def _more(self) -> bool:
        if self._eof:
            return False
        if len(self._buf) - self._pos > self.MAX_VALUE:
            raise ValueError("a JSON value larger than expected; is this an EC2 price list?")
        data = self._f.read(self._chunk)
        if not data:
            self._eof = True
            return False
        self._buf = self._buf[self._pos:] + data
        self._pos = 0
        return True

    def peek(self) -> str:
        while True:
            ws = self._WS.match(self._buf, self._pos)
            if ws is not None:          # always: the pattern matches the empty string
                self._pos = ws.end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._more():
                return ""

    def _expect(self, ch: str) -> None:
        got = self.peek()
        if got != ch:
            raise ValueError(f"expected {ch!r} in the JSON document, found {got!r}")
        self._pos += 1

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                v, end = self._dec.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError:
                if self._more():
                    continue
                raise
            # A number (or literal) at the very end of the buffer may go on in the next chunk.
            if end >= len(self._buf) and self._more():
                continue
            self._pos = end
            return v

    def members(self) -> Iterator[str]:
        self._expect("{")
        if self.peek() == "}":
            self._pos += 1
            return
        while True:
            key = self.value()
            if not isinstance(key, str):
                raise ValueError("an object key that is not a string")
            self._expect(":")
            yield key
            c = self.peek()
            self._pos += 1
            if c == "}":
                return
            if c != ",":
                raise ValueError(f"expected ',' or '}}' in the JSON document, found {c!r}")

    def items(self) -> Iterator[None]:
        self._expect("[")
        if self.peek() == "]":
            self._pos += 1
            return
        while True:
            yield None
            c = self.peek()
            self._pos += 1
            if c == "]":
                return
            if c != ",":
                raise ValueError(f"expected ',' or ']' in the JSON document, found {c!r}")

    def skip(self) -> None:
        """Pass over a value that may be huge (an object or array of many small values)."""
        c = self.peek()
        if c == "{":
            for _ in self.members():
                self.value()
        elif c == "[":
            for _ in self.items():
                self.value()
        else:
            self.value()


# --- one region's price list ------------------------------------------------------------------

def _wanted(product: Any, region: str, known: set[str]) -> str | None:
    """The instance type of a product row we price from, else None."""
    if not isinstance(product, dict):
        return None
    if product.get("productFamily") not in ("Compute Instance", "Compute Instance (bare metal)"):
        return None
    a = product.get("attributes") or {}
    itype = a.get("instanceType")
    if itype not in known:
        return None
    if (a.get("operatingSystem") != "Linux" or a.get("tenancy") != "Shared"
            or a.get("preInstalledSw") != "NA" or a.get("capacitystatus") != "Used"
            or a.get("licenseModel") != "No License required"):
        return None
    if a.get("regionCode", region) != region:
        return None          # Local Zones / Wavelength rows carry their own code
    if a.get("locationType", "AWS Region") != "AWS Region":
        return None
    if a.get("marketoption", "OnDemand") != "OnDemand":
        return None          # e.g. capacity blocks
    return str(itype)


def _hourly(terms: Any) -> float | None:
    best: float | None = None
    if not isinstance(terms, dict):
        return None
    for term in terms.values():
        for dim in (term.get("priceDimensions") or {}).values():
            if dim.get("unit") not in ("Hrs", "Hours", "Hour"):
                continue
            try:
                p = float((dim.get("pricePerUnit") or {})["USD"])
            except (KeyError, TypeError, ValueError):
                continue
            if p > 0 and (best is None or p < best):
                best = p
    return best


def parse_region_prices(f: IO[str], region: str, known: set[str],
                        chunk: int = 1 << 20) -> dict[str, float]:
    """On-demand $/h per known instance type from one region's price list (a text stream)."""
    js = JsonStream(f, chunk)
    sku_type: dict[str, str] = {}
    od: dict[str, float] = {}
    products_read = False
    for key in js.members():
        if key == "products":
            for sku in js.members():
                t = _wanted(js.value(), region, known)
                if t is not None:
                    sku_type[sku] = t
            products_read = True
        elif key == "terms":
            for kind in js.members():
                if kind != "OnDemand":
                    js.skip()
                    continue
                for sku in js.members():
                    terms = js.value()
                    if products_read and sku not in sku_type:
                        continue
                    p = _hourly(terms)
                    if p is not None:
                        od[sku] = p
        else:
            js.skip()
    out: dict[str, float] = {}
    for sku, t in sku_type.items():
        p = od.get(sku)
        if p is not None and (t not in out or p < out[t]):
            out[t] = p
    return out


# --- spot ------------------------------------------------------------------------------------

def default_client_factory(connect_timeout: float, read_timeout: float
                           ) -> tuple[ClientFactory | None, str]:
    """An EC2 client maker from boto3's usual credential chain, or (None, why not)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        return None, "boto3 is not installed (pip install 'cloudtrain[aws]')"
    session = boto3.Session()
    try:
        creds = session.get_credentials()
    except Exception as exc:  # noqa: BLE001 - a broken profile is "no credentials" here
        return None, f"AWS credentials could not be read ({exc})"
    if creds is None:
        return None, "no AWS credentials found"
    cfg = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                 retries={"max_attempts": 4, "mode": "standard"},
                 user_agent_extra="cloudtrain-catalog-refresh")

    def make(region: str) -> Any:
        return session.client("ec2", region_name=region, config=cfg)

    return make, ""


def spot_prices(client: Any, types: Iterable[str]) -> dict[str, float]:
    """Lowest current Linux/UNIX spot price over the region's zones, per instance type."""
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    pages = client.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=sorted(types), ProductDescriptions=["Linux/UNIX"],
        StartTime=datetime.now(timezone.utc))
    for page in pages:
        for item in page.get("SpotPriceHistory", []):
            try:
                price = float(item["SpotPrice"])
                key = (item["InstanceType"], item.get("AvailabilityZone") or
                       item.get("AvailabilityZoneId") or "")
            except (KeyError, TypeError, ValueError):
                continue
            ts = item.get("Timestamp") or datetime.min.replace(tzinfo=timezone.utc)
            if price <= 0:
                continue
            if key not in latest or ts > latest[key][0]:
                latest[key] = (ts, price)
    out: dict[str, float] = {}
    for (itype, _az), (_ts, price) in latest.items():
        if itype not in out or price < out[itype]:
            out[itype] = price
    return out


def _spot_error(exc: BaseException) -> str:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = (resp.get("Error") or {}).get("Code")
        if code:
            return str(code)
    return type(exc).__name__


# --- the source --------------------------------------------------------------------------------

def fetch(offers: list[Offer], http: Http, progress: Progress = noop, *,
          regions: Iterable[str] = (), client_factory: ClientFactory | None = None,
          spot_unavailable: str = "") -> SourceResult:
    """New prices for the AWS ``offers``. ``regions``: only these (default: every region in
    the index outside GovCloud/China). ``client_factory``: EC2 clients for spot; None with
    ``spot_unavailable`` saying why: the previous spot prices stay."""
    res = SourceResult("aws")
    known = {o.instance_type for o in offers if o.instance_type}
    if not known:
        res.notes.append("the catalog has no AWS instance types to price")
        return res
    urls = _region_urls(http, res, set(regions), progress)
    _on_demand(http, res, offers, urls, known, progress)
    _spot(res, offers, set(urls), client_factory, spot_unavailable, progress)
    return res


def _region_urls(http: Http, res: SourceResult, wanted: set[str],
                 progress: Progress) -> dict[str, str]:
    """The price list URL of each region to read (``wanted``, or every one outside
    GovCloud/China), from the region index, in region order."""
    base = base_url()
    index_url = base + INDEX_PATH
    host = http.host(index_url)
    index = http.get_json(index_url)
    res.urls.append(index_url)
    try:
        listed = {str(code): str(r["currentVersionUrl"])
                  for code, r in index["regions"].items()}
    except (KeyError, TypeError, AttributeError):
        raise SourceError(host, "the region index has no 'regions' with 'currentVersionUrl'") \
            from None
    todo = sorted(c for c in listed if not c.startswith(_OTHER_PARTITIONS)
                  and (not wanted or c in wanted))
    for r in sorted(r for r in wanted - set(listed) if re.match(r"^[a-z]{2}(-[a-z]+)+-\d+$", r)):
        res.notes.append(f"AWS has no price list for region '{r}'")
    progress(f"aws: {len(todo)} region price list{'s' if len(todo) != 1 else ''} to read "
             f"from {host}")
    return {region: (path if (path := listed[region]).startswith(("http://", "https://"))
                     else base + "/" + path.lstrip("/")) for region in todo}


def _on_demand(http: Http, res: SourceResult, offers: list[Offer], urls: dict[str, str],
               known: set[str], progress: Progress) -> None:
    """Each region's on-demand prices: updates of the offers there, new offers (an instance
    type the catalog knows, in a region it did not have it in) after a template of the type."""
    by_key = {(o.instance_type, o.region): o for o in offers}
    template: dict[str, Offer] = {}
    for o in offers:
        template.setdefault(o.instance_type, o)
    prices: dict[tuple[str, str], float] = {}
    for i, (region, url) in enumerate(urls.items(), start=1):
        found = _read_region(http, url, region, known)
        res.urls.append(url)
        for itype, p in found.items():
            prices[(itype, region)] = p
        progress(f"aws: {region} ({i}/{len(urls)}): {_types(len(found))} priced")
    for (itype, region), p in prices.items():
        old = by_key.get((itype, region))
        if old is not None:
            res.updates[offer_key(old)] = Quote(price=p)
        else:
            new = replace(template[itype], region=region, zones=(), price=p, spot_price=None)
            res.new_offers.append(new)


def _spot(res: SourceResult, offers: list[Offer], in_scope: set[str],
          client_factory: ClientFactory | None, spot_unavailable: str,
          progress: Progress) -> None:
    """Spot, for every region read that has AWS offers (old or new)."""
    by_key = {(o.instance_type, o.region): o for o in offers}
    types_by_region: dict[str, set[str]] = {}
    for o in [*offers, *res.new_offers]:
        if o.region in in_scope:
            types_by_region.setdefault(o.region, set()).add(o.instance_type)
    if client_factory is None:
        if types_by_region:
            res.notes.append("AWS spot prices were not refreshed "
                             f"({spot_unavailable or 'no EC2 client'}); "
                             "the previous spot prices stay")
        return
    failed: dict[str, list[str]] = {}
    new_by_key = {(o.instance_type, o.region): n for n, o in enumerate(res.new_offers)}
    for region in sorted(types_by_region):
        try:
            sp = spot_prices(client_factory(region), types_by_region[region])
        except Exception as exc:  # noqa: BLE001 - botocore's many errors: keep the old spot
            failed.setdefault(_spot_error(exc), []).append(region)
            continue
        for itype, p in sp.items():
            old = by_key.get((itype, region))
            if old is not None:
                q = res.updates.setdefault(offer_key(old), Quote())
                q.spot_price = p
            elif (itype, region) in new_by_key:
                n = new_by_key[(itype, region)]
                res.new_offers[n] = replace(res.new_offers[n], spot_price=p)
        progress(f"aws: spot {region}: {_types(len(sp))} priced")
    res.urls.append("ec2:DescribeSpotPriceHistory")
    for why, regs in sorted(failed.items()):
        res.notes.append(f"AWS spot prices kept for {', '.join(regs)} ({why})")


def _types(n: int) -> str:
    return f"{n} instance type{'s' if n != 1 else ''}"


def _read_region(http: Http, url: str, region: str, known: set[str]) -> dict[str, float]:
    host = http.host(url)
    with tempfile.TemporaryFile(prefix="cloudtrain-ec2-prices-") as tmp:
        http.download(url, tmp)
        tmp.seek(0)
        text = io.TextIOWrapper(tmp, encoding="utf-8")
        try:
            return parse_region_prices(text, region, known)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SourceError(host, f"the {region} price list could not be read ({exc})") from None
        finally:
            text.detach()
