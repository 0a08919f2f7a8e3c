"""GCP prices from the Cloud Billing Catalog API (Compute Engine, service ``6F81-5844-456A``).

``GET <base>/v1/services/6F81-5844-456A/skus?currencyCode=USD&pageSize=5000[&pageToken=...]``
with an API key (header ``X-Goog-Api-Key``) answers::

    {"skus": [{"description": "Nvidia Tesla A100 GPU running in Americas",
               "category": {"resourceFamily": "Compute", "resourceGroup": "GPU",
                            "usageType": "OnDemand"},
               "serviceRegions": ["us-central1", ...],
               "pricingInfo": [{"pricingExpression": {"usageUnit": "h",
                   "tieredRates": [{"unitPrice": {"units": "2", "nanos": 933908000}}]}}]},
              ...],
     "nextPageToken": "<the next page, or empty>"}

GCP prices parts, not machines, so a machine's price is built the way the snapshot builds it:

* a2/a3/g2/a4 machine types: vCPUs x "<FAMILY> Instance Core" + GiB x "<FAMILY> Instance Ram"
  + GPUs x the GPU SKU (A3 Mega: "A3Plus", A3 Ultra: "A3Ultra"; A4's GPU SKU is a "gpu slice"
  that carries its host when no A4 core/RAM SKUs are listed);
* N1 hosts with attached T4/V100/P100/P4 (``host_type`` or an ``n1-`` instance type): the host
  from "N1 Predefined Instance Core/Ram" + the GPUs; a GPU-only row stays GPU-only.

usageType OnDemand gives the price, Preemptible the spot price ("Spot Preemptible ..." and
"... attached to Spot Preemptible VMs ..." SKUs). Commitment, reservation, DWS/Flex-start,
custom and sole-tenancy SKUs are ignored. A price is the last tier's unitPrice (units + nanos).
An offer keeps its previous price when a part is missing. GCP regions are not added: a part
priced in a region does not mean the machine type is offered there.

``CLOUDTRAIN_GCP_BILLING_URL`` replaces ``https://cloudbilling.googleapis.com``.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any, Iterable

from ..model import Offer
from . import Progress, Quote, SourceError, SourceResult, noop, offer_key
from .httpfetch import Http

DEFAULT_BASE = "https://cloudbilling.googleapis.com"
SERVICE = "6F81-5844-456A"
ENV_BASE = "CLOUDTRAIN_GCP_BILLING_URL"
ENV_KEY = "CLOUDTRAIN_GCP_API_KEY"
PAGE_SIZE = 5000
MAX_PAGES = 500

_SPOT_PREFIX = re.compile(r"^(?:Spot Preemptible |Preemptible )")
_HOST = re.compile(r"^(?P<fam>[A-Za-z0-9 ]+?) Instance (?P<kind>Core|Ram) running in .+$")
_GPU = re.compile(r"^(?P<name>.+?)(?: GPU)?(?: attached to Spot Preemptible VMs)?"
                  r" running in .+$")
_IGNORED = ("commitment", "reserved", "dws", "calendar", "flex", "workstation", "custom",
            "sole tenancy", "extended", "premium", "license")
# GPU slices that carry their host: no core/RAM parts are added unless the family lists some.
_GPU_CARRIES_HOST = {"a4"}


def base_url() -> str:
    return (os.environ.get(ENV_BASE) or DEFAULT_BASE).rstrip("/")


def skus_url(base: str, page_token: str = "") -> str:
    q = {"currencyCode": "USD", "pageSize": str(PAGE_SIZE)}
    if page_token:
        q["pageToken"] = page_token
    return f"{base}/v1/services/{SERVICE}/skus?{urllib.parse.urlencode(q)}"


def gpu_model(name: str) -> str | None:
    """Canonical GPU name for a GPU SKU's name part ("Nvidia Tesla A100 80GB" -> A100-80GB)."""
    t = set(re.findall(r"[a-z0-9]+", name.lower()))
    if "b200" in t:
        return "B200"
    if "h200" in t:
        return "H200"
    if "h100" in t:
        return "H100-MEGA" if t & {"mega", "plus"} else "H100"
    if "a100" in t:
        return "A100-80GB" if "80gb" in t else "A100"
    for m in ("l4", "t4", "v100", "p100", "p4", "k80"):
        if m in t:
            return m.upper()
    return None


def unit_price(sku: dict[str, Any]) -> tuple[float, str] | None:
    try:
        expr = sku["pricingInfo"][0]["pricingExpression"]
        up = expr["tieredRates"][-1]["unitPrice"]
        return int(up.get("units") or 0) + int(up.get("nanos") or 0) / 1e9, str(expr["usageUnit"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class Parts:
    """$/h per part: GPU per model, core per vCPU and RAM per GiB per machine family; each
    keyed by (name, region, spot)."""

    def __init__(self) -> None:
        self.gpu: dict[tuple[str, str, bool], float] = {}
        self.core: dict[tuple[str, str, bool], float] = {}
        self.ram: dict[tuple[str, str, bool], float] = {}
        self.families: set[str] = set()

    @staticmethod
    def _put(table: dict[tuple[str, str, bool], float], name: str, regions: Iterable[str],
             spot: bool, price: float) -> None:
        for r in regions:
            k = (name, r, spot)
            if k not in table or price < table[k]:
                table[k] = price

    def add(self, sku: Any) -> bool:
        """Take one SKU if it is a part we price with; True if taken."""
        if not isinstance(sku, dict):
            return False
        cat = sku.get("category") or {}
        usage = cat.get("usageType")
        if cat.get("resourceFamily") != "Compute" or usage not in ("OnDemand", "Preemptible"):
            return False
        desc = str(sku.get("description", ""))
        low = desc.lower()
        if any(w in low for w in _IGNORED):
            return False
        regions = [r for r in sku.get("serviceRegions") or [] if isinstance(r, str)]
        up = unit_price(sku)
        if not regions or up is None:
            return False
        price, unit = up
        spot = usage == "Preemptible"
        plain = _SPOT_PREFIX.sub("", desc)
        m = _HOST.match(plain)
        if m:
            fam = m.group("fam").lower().replace(" ", "")
            if m.group("kind") == "Core" and unit == "h":
                self._put(self.core, fam, regions, spot, price)
            elif m.group("kind") == "Ram" and unit == "GiBy.h":
                self._put(self.ram, fam, regions, spot, price)
            else:
                return False
            self.families.add(fam)
            return True
        if cat.get("resourceGroup") == "GPU" or " gpu" in low:
            g = _GPU.match(plain)
            model = gpu_model(g.group("name")) if g else None
            if model is None or unit != "h":
                return False
            self._put(self.gpu, model, regions, spot, price)
            return True
        return False


_N1_RAM_PER_VCPU = {"standard": 3.75, "highmem": 6.5, "highcpu": 0.9}


def _host_shape(o: Offer, host: str) -> tuple[float, float] | None:
    if o.vcpus is not None and o.memory_gib is not None and o.host_type in (None, "", host) \
            and o.instance_type == host:
        return o.vcpus, o.memory_gib
    m = re.match(r"^n1-(standard|highmem|highcpu)-(\d+)$", host)
    if m:
        n = float(m.group(2))
        return n, n * _N1_RAM_PER_VCPU[m.group(1)]
    if o.vcpus is not None and o.memory_gib is not None:
        return o.vcpus, o.memory_gib
    return None


def host_families(machine: str) -> tuple[str, ...]:
    """The core/RAM SKU families that price a machine type (empty: unknown)."""
    n = machine.lower()
    if n.startswith("a3-megagpu"):
        return ("a3plus", "a3mega")
    if n.startswith("a3-ultragpu"):
        return ("a3ultra",)
    if n.startswith("a3-"):
        return ("a3",)
    fam = n.split("-", 1)[0]
    if fam == "n1":
        return ("n1predefined",)
    if fam in ("a2", "g2", "a4"):
        return (fam,)
    return ()


def price_offer(o: Offer, parts: Parts, spot: bool) -> float | None:
    if not o.accelerator:
        return None
    gpu = parts.gpu.get((o.accelerator, o.region, spot))
    if gpu is None:
        return None
    total = gpu * o.accelerator_count
    host = o.host_type or o.instance_type
    if not host:
        return total                       # a GPU-only row stays GPU-only
    fams = host_families(host)
    fam = next((f for f in fams if f in parts.families), fams[0] if fams else None)
    if fam is None:
        return None
    core, ram = parts.core.get((fam, o.region, spot)), parts.ram.get((fam, o.region, spot))
    if fam in _GPU_CARRIES_HOST and fam not in parts.families:
        return total
    shape = _host_shape(o, host)
    if core is None or ram is None or shape is None:
        return None
    return total + shape[0] * core + shape[1] * ram


def fetch(offers: list[Offer], http: Http, progress: Progress = noop, *, api_key: str,
          regions: Iterable[str] = ()) -> SourceResult:
    res = SourceResult("gcp")
    wanted = set(regions)
    offers = [o for o in offers if not wanted or o.region in wanted]
    if not offers:
        res.notes.append("the catalog has no GCP offers to price")
        return res
    base = base_url()
    headers = {"X-Goog-Api-Key": api_key}
    parts = Parts()
    token = ""
    seen: set[str] = set()
    pages = taken = 0
    first = skus_url(base)
    res.urls.append(first)
    while True:
        url = skus_url(base, token)
        data = http.get_json(url, headers=headers)
        if not isinstance(data, dict) or not isinstance(data.get("skus", []), list):
            raise SourceError(http.host(url), "the answer has no 'skus' list")
        for sku in data.get("skus", []):
            taken += parts.add(sku)
        pages += 1
        progress(f"gcp: page {pages} ({len(data.get('skus', []))} SKUs, {taken} GPU/core/RAM "
                 "prices so far)")
        token = str(data.get("nextPageToken") or "")
        if not token:
            break
        if token in seen or pages >= MAX_PAGES:
            raise SourceError(http.host(url), "the pages of SKUs do not end "
                              "(nextPageToken repeats)")
        seen.add(token)
    for o in offers:
        q = Quote(price=price_offer(o, parts, False), spot_price=price_offer(o, parts, True))
        if q.price is not None or q.spot_price is not None:
            res.updates[offer_key(o)] = q
    return res
