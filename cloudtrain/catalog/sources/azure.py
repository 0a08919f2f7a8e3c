"""Azure prices from the Retail Prices API (public, no account needed).

``GET <base>/api/retail/prices?api-version=2023-01-01-preview&$filter=serviceName eq 'Virtual
Machines' and priceType eq 'Consumption' and (armSkuName eq 'Standard_...' or ...)`` answers::

    {"BillingCurrency": "USD", "Items": [{"armSkuName": ..., "armRegionName": ...,
      "productName": ..., "skuName": ..., "meterName": ..., "retailPrice": ...,
      "unitOfMeasure": "1 Hour", "type": "Consumption", ...}, ...],
     "NextPageLink": "<the next page, or null>", "Count": 100}

Pages are followed through ``NextPageLink``. Windows products and Low Priority meters are
skipped; a meter or SKU name with "Spot" is the spot price, any other the on-demand price; the
lowest price per (size, region, kind) counts. Sizes the catalog knows that are priced in a
region it lacks become new offers there (government clouds excluded).

``CLOUDTRAIN_AZURE_PRICES_URL`` replaces ``https://prices.azure.com``.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import replace
from typing import Any, Iterable

from ..model import Offer
from . import Progress, Quote, SourceError, SourceResult, noop, offer_key
from .httpfetch import Http

DEFAULT_BASE = "https://prices.azure.com"
PATH = "/api/retail/prices"
API_VERSION = "2023-01-01-preview"
ENV_BASE = "CLOUDTRAIN_AZURE_PRICES_URL"
SIZES_PER_QUERY = 15
MAX_PAGES = 2000
_GOV = ("usgov", "usdod", "usnat", "ussec", "china")


def base_url() -> str:
    return (os.environ.get(ENV_BASE) or DEFAULT_BASE).rstrip("/")


def _odata(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def query_url(base: str, sizes: Iterable[str], regions: Iterable[str] = ()) -> str:
    parts = ["serviceName eq 'Virtual Machines'", "priceType eq 'Consumption'"]
    sizes = list(sizes)
    parts.append("(" + " or ".join(f"armSkuName eq {_odata(s)}" for s in sizes) + ")")
    regions = list(regions)
    if regions:
        parts.append("(" + " or ".join(f"armRegionName eq {_odata(r)}" for r in regions) + ")")
    flt = urllib.parse.quote(" and ".join(parts), safe="")
    return f"{base}{PATH}?api-version={API_VERSION}&$filter={flt}"


def classify(item: Any, sizes: set[str]) -> tuple[str, str, bool, float] | None:
    """(size, region, spot, $/h) for a usable price item, else None."""
    if not isinstance(item, dict):
        return None
    size, region = item.get("armSkuName"), item.get("armRegionName")
    if size not in sizes or not isinstance(region, str) or not region:
        return None
    if region.startswith(_GOV):
        return None
    if item.get("serviceName", "Virtual Machines") != "Virtual Machines":
        return None
    if item.get("type", "Consumption") != "Consumption":
        return None
    if item.get("currencyCode", "USD") != "USD":
        return None
    if "hour" not in str(item.get("unitOfMeasure", "1 Hour")).lower():
        return None
    names = f"{item.get('meterName', '')} {item.get('skuName', '')}"
    if "Windows" in str(item.get("productName", "")) or "Low Priority" in names:
        return None
    try:
        price = float(item["retailPrice"])
    except (KeyError, TypeError, ValueError):
        return None
    if price <= 0:
        return None
    return str(size), region, "Spot" in names, price


def fetch(offers: list[Offer], http: Http, progress: Progress = noop, *,
          regions: Iterable[str] = ()) -> SourceResult:
    res = SourceResult("azure")
    sizes = sorted({o.instance_type for o in offers if o.instance_type})
    if not sizes:
        res.notes.append("the catalog has no Azure sizes to price")
        return res
    base = base_url()
    regions = sorted(set(regions))
    found: dict[tuple[str, str], list[float | None]] = {}   # (size, region) -> [od, spot]
    pages = 0
    known = set(sizes)
    res.urls.append(f"{base}{PATH}?api-version={API_VERSION} ($filter: Virtual Machines, "
                    f"Consumption, {len(sizes)} sizes)")
    for start in range(0, len(sizes), SIZES_PER_QUERY):
        url: str | None = query_url(base, sizes[start:start + SIZES_PER_QUERY], regions)
        seen: set[str] = set()
        while url:
            if url in seen or len(seen) >= MAX_PAGES:
                raise SourceError(http.host(url), "the pages of prices do not end "
                                  "(NextPageLink repeats)")
            seen.add(url)
            data = http.get_json(url)
            if not isinstance(data, dict) or not isinstance(data.get("Items"), list):
                raise SourceError(http.host(url), "the answer has no 'Items' list")
            for item in data["Items"]:
                c = classify(item, known)
                if c is None:
                    continue
                size, region, spot, price = c
                slot = found.setdefault((size, region), [None, None])
                i = 1 if spot else 0
                held = slot[i]
                if held is None or price < held:
                    slot[i] = price
            pages += 1
            progress(f"azure: page {pages} ({len(data['Items'])} prices; "
                     f"{len(found)} size/region pairs so far)")
            nxt = data.get("NextPageLink")
            url = nxt if isinstance(nxt, str) and nxt else None

    by_key = {(o.instance_type, o.region): o for o in offers}
    template: dict[str, Offer] = {}
    for o in offers:
        template.setdefault(o.instance_type, o)
    for (size, region), (od, spot_price) in sorted(found.items()):
        old = by_key.get((size, region))
        if old is not None:
            res.updates[offer_key(old)] = Quote(price=od, spot_price=spot_price)
        elif od is not None:
            res.new_offers.append(replace(template[size], region=region, zones=(), price=od,
                                          spot_price=spot_price))
    return res
