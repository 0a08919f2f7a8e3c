#!/usr/bin/env python3
"""Regenerate the shipped catalog snapshot (cloudtrain/catalog/snapshot/) from the source data
in ../shared/catalog (see its README for provenance and known faults).

    python tools/build_catalog.py [--source DIR] [--out DIR] [--as-of YYYY-MM-DD] [--check]

What it writes, deterministically (same inputs -> byte-identical outputs):

- ``gpu_offers.csv`` in cloudtrain.catalog.store's format. Values are the source's, except that
  GCP GPUs that attach to N1 hosts (T4, V100, P100, P4; source rows with an empty instance type)
  become real offers on an n1-standard host (rule: ``N1_VCPUS_PER_GPU`` below).
- ``meta.json``: as_of, source, providers, the inputs' sha256 and a note on the date.
- ``overrides.json``: overrides.yaml as JSON, for the loader's speed (used only while it
  matches the YAML's sha256).
- the generated blocks of ``overrides.yaml`` (the GCP price-level corrections: the rule is
  applied to the data here, the loader applies the resulting rows) and of ``PROVENANCE.md``.
  Text outside the ``BEGIN generated`` / ``END generated`` markers is hand-written and kept.

Corrections are NOT applied to gpu_offers.csv: the loader applies overrides.yaml and its
sanity rules on every load (the same code path as a user-local catalog).

``as_of`` is the build date: the source commits carry no date. Re-running on unchanged inputs
keeps the recorded as_of, so the build is idempotent; ``--as-of`` sets it explicitly.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import json
import statistics
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cloudtrain.catalog.model import Offer  # noqa: E402
from cloudtrain.catalog.store import OFFERS_FILE, _fmt, write_offers  # noqa: E402

DEFAULT_SOURCE = REPO.parent / "shared" / "catalog"
DEFAULT_OUT = REPO / "cloudtrain" / "catalog" / "snapshot"
INPUTS = ("gpu_offers.csv", "gcp_accelerator_prices.csv", "gcp_n1_standard_hosts.csv", "README.md")

# GCP N1 host rule: 8 vCPUs per GPU, at most 32 (n1-standard-8/-16/-32/-32 for 1/2/4/8 GPUs).
# Within every attachable GPU's vCPU limit, and never beyond n1-standard-32, the largest shape
# whose price the source transcribes. n1-standard-N = N/2 x n1-standard-2 (the source's n1
# prices are linear in vCPUs); N = 32 uses the transcribed n1-standard-32 price.
N1_VCPUS_PER_GPU = 8
N1_MAX_VCPUS = 32
N1_GIB_PER_VCPU = 3.75

# GCP price levels: per accelerator model, the per-GPU on-demand accelerator prices of the
# regions are sorted; a jump of at least this ratio between neighbours splits them into a low
# and a high level. The low level is the suspect one (see overrides.yaml).
LEVEL_GAP_RATIO = 1.3

SOURCE_LINE = ("SkyPilot catalog (github.com/skypilot-org/skypilot-catalog, Apache-2.0): "
               "aws catalogs/v8 @e385a0d, gcp catalogs/v8 @8427bbf, azure catalogs/v6 @098741e")
AS_OF_NOTE = ("as_of is the date this snapshot was built; the upstream commits carry no date, "
              "so the prices' own date is unknown (2025-2026)")


def _num(v: str) -> float | None:
    v = (v or "").strip()
    return float(v) if v else None


def _r5(v: float) -> float:
    return round(v + 0.0, 5)


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# --- GCP N1 hosts ---------------------------------------------------------------------------

def n1_vcpus(count: float) -> int:
    return int(min(N1_VCPUS_PER_GPU * max(count, 1), N1_MAX_VCPUS))


HostPrices = dict[tuple[str, int], tuple[float | None, float | None]]


def n1_host_prices(rows: list[dict[str, str]]) -> HostPrices:
    """(region, vcpus) -> (on-demand, spot) for the transcribed n1-standard-2 and -32."""
    out = {}
    for r in rows:
        out[(r["region"], int(float(r["vcpus"])))] = (_num(r["price_hourly_usd"]),
                                                      _num(r["spot_price_hourly_usd"]))
    return out


def n1_host_price(hosts: HostPrices, region: str, vcpus: int) -> tuple[float | None, float | None]:
    if (region, vcpus) in hosts:
        return hosts[(region, vcpus)]
    base = hosts.get((region, 2))
    if base is None:
        return None, None
    f = vcpus / 2
    return (None if base[0] is None else _r5(base[0] * f),
            None if base[1] is None else _r5(base[1] * f))


# --- offers ---------------------------------------------------------------------------------

def build_offers(src: Path) -> tuple[list[Offer], dict[str, int]]:
    hosts = n1_host_prices(_read(src / "gcp_n1_standard_hosts.csv"))
    offers: list[Offer] = []
    stats: dict[str, int] = defaultdict(int)
    for r in _read(src / "gpu_offers.csv"):
        count = float(r["accelerator_count"])
        price, spot = _num(r["price_hourly_usd"]), _num(r["spot_price_hourly_usd"])
        it, host_type = r["instance_type"], None
        vcpus, mem = _num(r["vcpus"]), _num(r["memory_gib"])
        if r["price_basis"] == "gcp_accelerator_only_add_n1_host":
            n = n1_vcpus(count)
            it = host_type = f"n1-standard-{n}"
            vcpus, mem = float(n), n * N1_GIB_PER_VCPU
            hp, hs = n1_host_price(hosts, r["region"], n)
            if hp is None:
                stats["n1_no_host_price"] += 1
            price = _r5(price + hp) if price is not None and hp is not None else None
            spot = _r5(spot + hs) if spot is not None and hs is not None else None
            stats["n1_expanded"] += 1
        elif not it:
            raise SystemExit(f"unexpected row without instance type: {r}")
        offers.append(Offer(
            provider=r["provider"], instance_type=it, accelerator=r["accelerator"] or None,
            accelerator_count=count, gpu_memory_gib=_num(r["gpu_memory_gib"]), vcpus=vcpus,
            memory_gib=mem, region=r["region"],
            zones=tuple(z for z in r["zones"].split(";") if z), price=price, spot_price=spot,
            arch=r["arch"] or None, host_type=host_type))
        stats[r["provider"]] += 1
    offers.sort(key=lambda o: (o.provider, o.accelerator or "", o.accelerator_count,
                               o.instance_type, o.region))
    return offers, dict(stats)


# --- GCP price levels -----------------------------------------------------------------------

def gcp_price_levels(src: Path, offers: list[Offer]) -> list[dict]:
    """Per accelerator with two price levels: the low regions, the replacement per-GPU price
    and the corrected offer rows. See overrides.yaml for the rule in words."""
    acc_total: dict[tuple[str, float, str], float] = {}   # (acc, count, region) -> min over zones
    spot_per_gpu: dict[tuple[str, str], float] = {}        # (acc, region) -> min $/GPU-h
    for r in _read(src / "gcp_accelerator_prices.csv"):
        p, s = _num(r["price_hourly_usd"]), _num(r["spot_price_hourly_usd"])
        if s is not None:
            k2 = (r["accelerator"], r["region"])
            v = s / float(r["accelerator_count"])
            spot_per_gpu[k2] = min(v, spot_per_gpu.get(k2, v))
        if p is None:
            continue
        k = (r["accelerator"], float(r["accelerator_count"]), r["region"])
        acc_total[k] = min(p, acc_total.get(k, p))
    per_gpu: dict[str, dict[str, float]] = defaultdict(dict)   # acc -> region -> $/GPU-h
    for (acc, n, region), p in acc_total.items():
        v = p / n
        per_gpu[acc][region] = min(v, per_gpu[acc].get(region, v))
    out = []
    for acc in sorted(per_gpu):
        regions = per_gpu[acc]
        values = sorted(set(round(v, 4) for v in regions.values()))
        gaps = [(values[i + 1] / values[i], values[i]) for i in range(len(values) - 1)]
        if not gaps:
            continue
        ratio, cut = max(gaps)
        if ratio < LEVEL_GAP_RATIO:
            continue
        low = sorted(r for r, v in regions.items() if round(v, 4) <= cut)
        high = {r: v for r, v in regions.items() if round(v, 4) > cut}
        to: dict[str, float] = {}
        basis: dict[str, str] = {}
        for region in low:
            area = region.split("-")[0]
            same = [v for r, v in high.items() if r.split("-")[0] == area]
            pool = same or list(high.values())
            to[region] = _r5(statistics.median(pool))
            basis[region] = (f"median of {len(same)} high-level '{area}-*' region(s)" if same
                             else f"median of all {len(high)} high-level regions")
        rows = []
        for o in offers:
            if (o.provider == "gcp" and o.accelerator == acc and o.region in to
                    and o.price is not None):
                old_acc = acc_total[(acc, o.accelerator_count, o.region)]
                new = _r5(o.price - old_acc + o.accelerator_count * to[o.region])
                rows.append([o.instance_type, o.region, o.price, new])
        rows.sort(key=lambda x: (x[0], x[1]))
        below_spot = [r for r in low if spot_per_gpu.get((acc, r), 0) >= regions[r]]
        out.append({"accelerator": acc, "gap_ratio": round(ratio, 2), "below_spot": below_spot,
                    "low": {r: round(regions[r], 5) for r in low},
                    "high": {r: round(v, 5) for r, v in sorted(high.items())},
                    "to": to, "basis": basis, "rows": rows})
    return out


def _span(values) -> str:  # type: ignore[no-untyped-def]
    lo, hi = min(values), max(values)
    return _fmt(lo) if lo == hi else f"{_fmt(lo)}-{_fmt(hi)}"


def _flow(values: dict[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {_fmt(v)}" for r, v in values.items()) + "}"


def render_levels(levels: list[dict]) -> str:
    lines = []
    for lv in levels:
        acc = lv["accelerator"]
        slug = acc.lower().replace(" ", "-")
        lines += [
            f"  - id: gcp-{slug}-price-level",
            f"    match: {{provider: gcp, accelerator: {acc}, regions: [{', '.join(lv['low'])}]}}",
            "    field: price",
            "    rule: raise-accelerator-part-to-high-level",
            "    reason: >-",
            *textwrap.wrap(
                f"{acc}: the accelerator part is at two levels across regions, low "
                f"{_span(lv['low'].values())} against high {_span(lv['high'].values())} $/GPU-h "
                f"(gap x{lv['gap_ratio']})"
                + (f"; at the low level on-demand is even at or below spot in "
                   f"{', '.join(lv['below_spot'])}." if lv["below_spot"] else "."),
                width=94, initial_indent="      ", subsequent_indent="      "),
            "    reference: ../shared/catalog/README.md, 'GCP accelerator prices are bimodal'",
            "    # $/GPU-h of the accelerator part, as in the source",
            "    low_per_gpu: " + _flow(lv["low"]),
            "    high_per_gpu: " + _flow(lv["high"]),
            "    # the replacement $/GPU-h per low region and how it was chosen",
            "    to_per_gpu: " + _flow(lv["to"]),
        ]
        by_basis: dict[str, list[str]] = defaultdict(list)
        for region, b in lv["basis"].items():
            by_basis[b].append(region)
        for b, regs in sorted(by_basis.items()):
            lines.append(f"    #   {', '.join(regs)}: {b}")
        lines.append("    rows:   # [instance_type, region, from, to]: $/h per node, on-demand")
        for it, region, old, new in lv["rows"]:
            lines.append(f"      - [{it}, {region}, {_fmt(old)}, {_fmt(new)}]")
    return "\n".join(lines) + "\n"


# --- files ----------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def replace_block(text: str, name: str, body: str, comment: str = "#") -> str:
    if comment == "#":
        begin, end = f"# BEGIN generated: {name}", f"# END generated: {name}"
    else:
        begin, end = f"<!-- BEGIN generated: {name} -->", f"<!-- END generated: {name} -->"
    try:
        head, rest = text.split(begin + "\n", 1)
        _, tail = rest.split(end, 1)
    except ValueError:
        raise SystemExit(f"markers for '{name}' not found") from None
    return f"{head}{begin}\n{body}{end}{tail}"


def render_summary(offers: list[Offer], stats: dict[str, int], levels: list[dict],
                   inputs: dict[str, str]) -> str:
    per = defaultdict(int)
    for o in offers:
        per[o.provider] += 1
    lines = ["| provider | offers |", "|---|---|"]
    lines += [f"| {p} | {n} |" for p, n in sorted(per.items())]
    lines += [f"| total | {len(offers)} |", "",
              f"- GCP N1-attachable rows turned into n1-standard offers: "
              f"{stats.get('n1_expanded', 0)} (without a host price: "
              f"{stats.get('n1_no_host_price', 0)}).",
              "- GCP accelerators with two price levels (corrected in overrides.yaml): "
              + (", ".join(f"{lv['accelerator']} ({len(lv['rows'])} offers)" for lv in levels)
                 or "none") + ".",
              "", "Input files (sha256):", ""]
    lines += [f"- `{name}`: `{digest}`" for name, digest in inputs.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--as-of", help="ISO date to record (default: kept if inputs are unchanged, "
                                    "else today, UTC)")
    ap.add_argument("--check", action="store_true",
                    help="Write nothing; exit 1 if the snapshot is not what the build produces.")
    a = ap.parse_args(argv)
    src, out = a.source, a.out
    missing = [n for n in INPUTS if not (src / n).is_file()]
    if missing:
        print(f"source files missing in {src}: {', '.join(missing)}", file=sys.stderr)
        return 2
    inputs = {n: _sha256(src / n) for n in INPUTS}
    offers, stats = build_offers(src)
    levels = gcp_price_levels(src, offers)

    old_meta = {}
    if (out / "meta.json").is_file():
        old_meta = json.loads((out / "meta.json").read_text())
    if a.as_of:
        as_of = dt.date.fromisoformat(a.as_of).isoformat()
    elif old_meta.get("inputs") == inputs and old_meta.get("as_of"):
        as_of = str(old_meta["as_of"])
    else:
        as_of = dt.datetime.now(dt.timezone.utc).date().isoformat()
    meta = {"as_of": as_of, "source": SOURCE_LINE,
            "providers": sorted({o.provider for o in offers}),
            "as_of_note": AS_OF_NOTE, "built_by": "tools/build_catalog.py", "inputs": inputs}

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        write_offers(t / OFFERS_FILE, offers)
        files = {
            OFFERS_FILE: (t / OFFERS_FILE).read_text(),
            "meta.json": json.dumps(meta, indent=2) + "\n",
            "overrides.yaml": replace_block((out / "overrides.yaml").read_text(),
                                            "gcp-price-levels", render_levels(levels)),
            "PROVENANCE.md": replace_block((out / "PROVENANCE.md").read_text(), "build-summary",
                                           render_summary(offers, stats, levels, inputs), "md"),
        }
    import yaml

    files["overrides.json"] = json.dumps(
        {"yaml_sha256": hashlib.sha256(files["overrides.yaml"].encode()).hexdigest(),
         "note": "generated by tools/build_catalog.py from overrides.yaml; edit that file",
         "doc": yaml.safe_load(files["overrides.yaml"])}, indent=1, sort_keys=True) + "\n"
    changed = [n for n, text in files.items()
               if not (out / n).is_file() or (out / n).read_text() != text]
    if a.check:
        if changed:
            print("snapshot differs from the build: " + ", ".join(changed), file=sys.stderr)
            return 1
        print("snapshot is up to date")
        return 0
    for n in changed:
        tmp_path = out / (n + ".tmp")
        tmp_path.write_text(files[n])
        tmp_path.replace(out / n)
    print(f"{len(offers)} offers; " + (f"updated {', '.join(changed)}" if changed else "no change"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
