"""Reading and writing offers as CSV, the one format for the shipped snapshot and for the
user-local catalog that ``catalog refresh`` writes (``$CLOUDTRAIN_HOME/catalog/``).

A catalog folder holds ``gpu_offers.csv`` (COLUMNS below) and ``meta.json``
(``{"as_of", "source", "providers"}``).
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Iterable

from .model import CatalogInfo, Offer

COLUMNS = ("provider", "instance_type", "accelerator", "accelerator_count", "gpu_memory_gib",
           "vcpus", "memory_gib", "region", "zones", "price", "spot_price", "arch", "host_type")
OFFERS_FILE = "gpu_offers.csv"
META_FILE = "meta.json"


def _num(v: str) -> float | None:
    v = v.strip()
    return float(v) if v else None


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:.6f}".rstrip("0").rstrip(".")


def parse_offers(text: str, source: str = "gpu_offers.csv") -> list[Offer]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{source}: missing column(s) {', '.join(missing)}")
    out = []
    for i, r in enumerate(reader, start=2):
        try:
            out.append(Offer(
                provider=r["provider"], instance_type=r["instance_type"],
                accelerator=r["accelerator"] or None,
                accelerator_count=float(r["accelerator_count"] or 0),
                gpu_memory_gib=_num(r["gpu_memory_gib"]), vcpus=_num(r["vcpus"]),
                memory_gib=_num(r["memory_gib"]), region=r["region"],
                zones=tuple(z for z in r["zones"].split(";") if z),
                price=_num(r["price"]), spot_price=_num(r["spot_price"]),
                arch=r["arch"] or None, host_type=r["host_type"] or None))
        except ValueError as exc:
            raise ValueError(f"{source}, line {i}: {exc}") from None
    return out


def read_offers(path: Path) -> list[Offer]:
    return parse_offers(path.read_text(), str(path))


def write_offers(path: Path, offers: Iterable[Offer]) -> None:
    """Write atomically (a reader never sees half a file)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for o in offers:
        w.writerow([o.provider, o.instance_type, o.accelerator or "", _fmt(o.accelerator_count),
                    _fmt(o.gpu_memory_gib), _fmt(o.vcpus), _fmt(o.memory_gib), o.region,
                    ";".join(o.zones), _fmt(o.price), _fmt(o.spot_price), o.arch or "",
                    o.host_type or ""])
    _atomic_write(path, buf.getvalue())


def read_meta(folder: Path) -> dict[str, object]:
    return json.loads((folder / META_FILE).read_text())


def write_meta(folder: Path, info: CatalogInfo) -> None:
    _atomic_write(folder / META_FILE, json.dumps(
        {"as_of": info.as_of, "source": info.source, "providers": list(info.providers)},
        indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
