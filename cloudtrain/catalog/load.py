"""Load the GPU offer catalog: the user-local one (``$CLOUDTRAIN_HOME/catalog/``, written by
``catalog refresh``) when it exists and is usable, else the snapshot shipped in the package.

Every load applies the documented corrections in ``snapshot/overrides.yaml`` and then the
sanity rules of :func:`_sanitize` (the same for both kinds of catalog); what they changed is
counted in ``CatalogInfo.corrections``. A user-local catalog that cannot be read falls back to
the snapshot with a message in ``Catalog.warnings``.

    cat = load_catalog(env.home)
    cat.find("A100", 8, provider="aws")      # cheapest on-demand first
    cat.find("H100", 8, spot=True)           # cheapest spot first
    cat.info.kind, cat.info.as_of, cat.age_days()

Results are cached per process (keyed by the home and the user-local files' mtime and size).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from .gpus import canonical_gpu, gpu_info
from .model import CatalogInfo, Offer
from .store import META_FILE, OFFERS_FILE, parse_offers

__all__ = ["Catalog", "CatalogError", "SNAPSHOT_DIR", "USER_SUBDIR", "canonical_gpu",
           "clear_cache", "load_catalog", "load_folder", "user_catalog_dir"]

SNAPSHOT_DIR = Path(__file__).resolve().parent / "snapshot"
OVERRIDES_PATH = SNAPSHOT_DIR / "overrides.yaml"
USER_SUBDIR = "catalog"
OVERRIDABLE = ("accelerator_count", "gpu_memory_gib", "price", "spot_price", "vcpus",
               "memory_gib")


class CatalogError(ValueError):
    """A catalog folder (or the overrides file) cannot be used."""


@dataclass
class Catalog:
    """The offers in use and where they come from. Shared through the per-process cache:
    treat it as read-only."""

    offers: list[Offer]
    info: CatalogInfo
    warnings: tuple[str, ...] = ()
    note: str = ""                      # meta.json's as_of_note, if any

    def find(self, accelerator: str | None = None, count: float | None = None,
             provider: str | None = None, region: str | None = None,
             instance_type: str | None = None, spot: bool = False) -> list[Offer]:
        """Offers matching every given filter, cheapest first by the spot price (``spot``)
        or the on-demand price; offers without that price are left out. ``accelerator``
        takes any alias (``a100-40gb``); ``count`` is GPUs per node, exactly."""
        acc = None
        if accelerator is not None:
            acc = (canonical_gpu(accelerator) or accelerator).casefold()
        prov = provider.casefold() if provider else None
        reg = region.casefold() if region else None
        itype = instance_type.casefold() if instance_type else None
        out = []
        for o in self.offers:
            p = o.spot_price if spot else o.price
            if p is None:
                continue
            if acc is not None and (o.accelerator or "").casefold() != acc:
                continue
            if count is not None and not math.isclose(o.accelerator_count, count, abs_tol=1e-9):
                continue
            if prov is not None and o.provider != prov:
                continue
            if reg is not None and o.region.casefold() != reg:
                continue
            if itype is not None and o.instance_type.casefold() != itype:
                continue
            out.append(o)
        out.sort(key=lambda o: (o.hourly(spot), o.provider, o.region, o.instance_type,
                                o.accelerator or "", o.accelerator_count))
        return out

    def age_days(self, now: datetime.datetime | None = None) -> float | None:
        """Days since ``info.as_of`` (never negative), or None if as_of is not a date."""
        when = parse_as_of(self.info.as_of)
        if when is None:
            return None
        now = now or datetime.datetime.now(datetime.timezone.utc)
        return max(0.0, (now - when).total_seconds() / 86400.0)

    def per_provider(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.offers:
            out[o.provider] = out.get(o.provider, 0) + 1
        return dict(sorted(out.items()))

    def accelerators(self) -> list[str]:
        return sorted({o.accelerator for o in self.offers if o.accelerator})

    def regions(self, provider: str | None = None) -> list[str]:
        return sorted({o.region for o in self.offers if provider is None or o.provider == provider})


def parse_as_of(text: str) -> datetime.datetime | None:
    try:
        if len(text) == 10:
            d = datetime.date.fromisoformat(text)
            return datetime.datetime(d.year, d.month, d.day, tzinfo=datetime.timezone.utc)
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


# --- loading and caching --------------------------------------------------------------------

_CACHE: dict[Any, Catalog] = {}


def clear_cache() -> None:
    _CACHE.clear()
    _OVERRIDES.clear()


def user_catalog_dir(home: Path) -> Path:
    return Path(home) / USER_SUBDIR


def _stamp(folder: Path) -> tuple[Any, ...]:
    out: list[Any] = []
    for name in (OFFERS_FILE, META_FILE):
        try:
            st = os.stat(folder / name)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def load_catalog(home: Path | None = None) -> Catalog:
    """The catalog in use. ``home`` is ``$CLOUDTRAIN_HOME`` (``Env.home``): its ``catalog/``
    folder wins when it exists and can be used; ``None``: the shipped snapshot only."""
    user = user_catalog_dir(home) if home is not None else None
    stamp = _stamp(user) if user is not None else None
    key = (str(user) if user else None, stamp)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    cat = _load(user, stamp)
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[key] = cat
    return cat


def provider_offers(home: Path | None, provider: str) -> list[Offer]:
    """The offers of one provider in the catalog in use (what a cloud provider plans from)."""
    return [o for o in load_catalog(home).offers if o.provider == provider]


def _load(user: Path | None, stamp: tuple[Any, ...] | None) -> Catalog:
    if user is not None and stamp is not None and any(s is not None for s in stamp):
        try:
            return load_folder(user, "user")
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with a user's files, fall back
            snap = _snapshot()
            msg = (f"The user-local catalog in {user} cannot be used ({exc}); using the catalog "
                   f"shipped with cloudtrain (as of {snap.info.as_of}). Run 'cloudtrain catalog "
                   f"refresh' to rebuild it, or delete that folder.")
            return replace(snap, warnings=snap.warnings + (msg,))
    return _snapshot()


def _snapshot() -> Catalog:
    key = ("snapshot",)
    if key not in _CACHE:
        _CACHE[key] = load_folder(SNAPSHOT_DIR, "snapshot")
    return _CACHE[key]


def load_folder(folder: Path, kind: str) -> Catalog:
    """Read, correct and check one catalog folder (``gpu_offers.csv`` + ``meta.json``)."""
    import json

    missing = [n for n in (OFFERS_FILE, META_FILE) if not (folder / n).is_file()]
    if missing:
        raise CatalogError(f"{', '.join(missing)} missing")
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except ValueError as exc:
        raise CatalogError(f"{META_FILE} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("as_of"), str) \
            or parse_as_of(meta["as_of"]) is None:
        raise CatalogError(f"{META_FILE} has no as_of date")
    try:
        offers = parse_offers((folder / OFFERS_FILE).read_text(), OFFERS_FILE)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None
    offers, notes = apply_overrides(offers, load_overrides())
    offers, more = _sanitize(offers)
    if not offers:
        raise CatalogError("no usable offers")
    info = CatalogInfo(kind=kind, path=str(folder), as_of=meta["as_of"],
                       source=str(meta.get("source") or "unknown"),
                       providers=tuple(sorted({o.provider for o in offers})),
                       corrections=tuple(notes + more))
    return Catalog(offers=offers, info=info, note=str(meta.get("as_of_note") or ""))


# --- overrides ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Override:
    id: str
    provider: str
    field: str
    instance_types: frozenset[str] | None = None
    accelerators: frozenset[str] | None = None
    regions: frozenset[str] | None = None
    guarded: bool = False               # `from` given: apply only while the value is that
    from_value: float | None = None
    to: float | None = None
    rows: dict[tuple[str, str], tuple[float | None, float | None]] = dataclasses.field(
        default_factory=dict)

    def matches(self, o: Offer) -> bool:
        if o.provider != self.provider:
            return False
        if self.instance_types is not None and o.instance_type not in self.instance_types:
            return False
        if self.accelerators is not None and (o.accelerator or "") not in self.accelerators:
            return False
        return self.regions is None or o.region in self.regions


_OVERRIDES: dict[str, list[Override]] = {}


def load_overrides(path: Path = OVERRIDES_PATH) -> list[Override]:
    """The overrides in ``path``. tools/build_catalog.py also writes them as JSON next to it
    (``overrides.json``, with the YAML's sha256): parsing that is ~10x faster than importing
    and running a YAML parser, and it is used only while it matches the YAML byte for byte."""
    key = str(path)
    if key not in _OVERRIDES:
        raw = path.read_bytes()
        doc = _compiled_overrides(path, raw)
        if doc is None:
            doc = _yaml_doc(raw.decode(), str(path))
        _OVERRIDES[key] = overrides_from_doc(doc, str(path))
    return _OVERRIDES[key]


def _compiled_overrides(path: Path, raw: bytes) -> Any:
    import hashlib
    import json

    try:
        compiled = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(compiled, dict) or \
            compiled.get("yaml_sha256") != hashlib.sha256(raw).hexdigest():
        return None
    return compiled.get("doc")


def _yaml_doc(text: str, source: str) -> Any:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{source}: {exc}") from None


def _names(v: Any) -> frozenset[str] | None:
    if v is None or v == "*":
        return None
    if isinstance(v, str):
        return frozenset([v])
    return frozenset(str(x) for x in v)


def _value(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CatalogError(f"{where}: {v!r} is not a number")
    return float(v)


def parse_overrides(text: str, source: str = "overrides.yaml") -> list[Override]:
    return overrides_from_doc(_yaml_doc(text, source), source)


def overrides_from_doc(doc: Any, source: str = "overrides.yaml") -> list[Override]:
    if doc is not None and not isinstance(doc, dict):
        raise CatalogError(f"{source}: expected a mapping with 'overrides'")
    entries = (doc or {}).get("overrides") or []
    out = []
    for i, e in enumerate(entries):
        where = f"{source}: override {e.get('id', i) if isinstance(e, dict) else i}"
        if not isinstance(e, dict) or not isinstance(e.get("match"), dict):
            raise CatalogError(f"{where}: needs 'match'")
        m, fld = e["match"], e.get("field")
        if fld not in OVERRIDABLE:
            raise CatalogError(f"{where}: field must be one of {', '.join(OVERRIDABLE)}")
        if not m.get("provider") or not e.get("id"):
            raise CatalogError(f"{where}: needs 'id' and match.provider")
        if not e.get("reason") or not e.get("reference"):
            raise CatalogError(f"{where}: needs 'reason' and 'reference'")
        rows: dict[tuple[str, str], tuple[float | None, float | None]] = {}
        for r in e.get("rows") or []:
            if not isinstance(r, list) or len(r) != 4:
                raise CatalogError(f"{where}: rows are [instance_type, region, from, to]")
            rows[(str(r[0]), str(r[1]))] = (_value(r[2], where), _value(r[3], where))
        if not rows and "to" not in e:
            raise CatalogError(f"{where}: needs 'to' or 'rows'")
        accs = _names(m.get("accelerator"))
        if accs is not None:
            accs = frozenset(canonical_gpu(a) or a for a in accs)
        out.append(Override(
            id=str(e["id"]), provider=str(m["provider"]), field=fld,
            instance_types=_names(m.get("instance_type")), accelerators=accs,
            regions=_names(m.get("regions", "*")), guarded="from" in e,
            from_value=_value(e.get("from"), where), to=_value(e.get("to"), where), rows=rows))
    return out


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


def apply_overrides(offers: list[Offer],
                    overrides: list[Override]) -> tuple[list[Offer], list[str]]:
    by_provider: dict[str, list[Override]] = {}
    for ov in overrides:
        by_provider.setdefault(ov.provider, []).append(ov)
    counts = {ov.id: 0 for ov in overrides}
    out = []
    for o in offers:
        for ov in by_provider.get(o.provider, ()):
            if not ov.matches(o):
                continue
            cur = getattr(o, ov.field)
            if ov.rows:
                row = ov.rows.get((o.instance_type, o.region))
                if row is None or not _same(cur, row[0]):
                    continue
                new = row[1]
            else:
                if ov.guarded and not _same(cur, ov.from_value):
                    continue
                new = ov.to
            if not _same(cur, new):
                change: dict[str, Any] = {ov.field: new}   # the field is the override's
                o = replace(o, **change)
                counts[ov.id] += 1
        out.append(o)
    notes = []
    for ov in overrides:
        n = counts[ov.id]
        if not n:
            continue
        what = (f"{ov.field} {_g(ov.from_value) if ov.guarded else '*'} -> {_g(ov.to)}"
                if not ov.rows else f"{ov.field} corrected")
        notes.append(f"{ov.id}: {what} on {_n(n)}")
    return out, notes


# --- sanity rules ---------------------------------------------------------------------------

def _g(v: float | None) -> str:
    return "none" if v is None else f"{v:g}"


def _n(n: int) -> str:
    return f"{n} offer" + ("" if n == 1 else "s")


def _label(o: Offer) -> str:
    return f"{o.provider} {o.instance_type} {o.region}"


class _Tally:
    def __init__(self) -> None:
        self.items: dict[str, list[str]] = {}

    def add(self, rule: str, example: str) -> None:
        self.items.setdefault(rule, []).append(example)

    def lines(self, texts: dict[str, str]) -> list[str]:
        out = []
        for rule, text in texts.items():
            ex = self.items.get(rule)
            if ex:
                out.append(f"rule {rule}: {text.format(n=_n(len(ex)))} (e.g. {ex[0]})")
        return out


_RULES = {
    "incomplete": "{n} missing provider, instance type, region or GPU model dropped",
    "gpu-name": "GPU names made canonical on {n}",
    "price-not-positive": "a price <= 0 treated as missing on {n}",
    "no-price": "{n} with no price at all dropped",
    "spot-not-below-on-demand": "spot price dropped on {n} (spot >= on-demand: no saving)",
    "spot-only": "{n} without an on-demand price kept as spot-only",
    "gpu-count": "{n} with a GPU count the model is not sold in dropped",
    "gpu-memory-filled": "per-GPU memory filled from the GPU table on {n}",
    "gpu-memory-range": "implausible per-GPU memory replaced from the GPU table on {n}",
    "unknown-gpu": "{n} with a GPU model cloudtrain does not know kept unchecked",
    "duplicate": "{n} duplicating an earlier row dropped",
}


def _sanitize(offers: Iterable[Offer]) -> tuple[list[Offer], list[str]]:
    """The sanity rules, in order; returns the offers kept and one line per rule that fired."""
    t = _Tally()
    out: list[Offer] = []
    seen: set[tuple[str, str, str, str, float]] = set()
    for o in offers:
        if not (o.provider and o.instance_type and o.region):
            t.add("incomplete", _label(o))
            continue
        changes: dict[str, Any] = {}
        acc = o.accelerator
        if acc:
            canon = canonical_gpu(acc)
            if canon and canon != acc:
                t.add("gpu-name", f"{acc} -> {canon}")
                changes["accelerator"] = acc = canon
        price, spot = o.price, o.spot_price
        if (price is not None and price <= 0) or (spot is not None and spot <= 0):
            t.add("price-not-positive", _label(o))
            if price is not None and price <= 0:
                changes["price"] = price = None
            if spot is not None and spot <= 0:
                changes["spot_price"] = spot = None
        if price is None and spot is None:
            t.add("no-price", _label(o))
            continue
        if price is not None and spot is not None and spot >= price - 1e-9:
            t.add("spot-not-below-on-demand",
                  f"{_label(o)} spot {spot:g} vs {price:g}")
            changes["spot_price"] = spot = None
        if price is None:
            t.add("spot-only", _label(o))
        if acc:
            info = gpu_info(acc)
            if info is None:
                t.add("unknown-gpu", f"{acc} on {_label(o)}")
            else:
                if not any(math.isclose(o.accelerator_count, c, abs_tol=1e-9) for c in info.counts):
                    t.add("gpu-count", f"{_label(o)} {acc} x{o.accelerator_count:g}")
                    continue
                mem = o.gpu_memory_gib
                fill = info.memory_gib * min(o.accelerator_count, 1.0)
                if mem is None:
                    t.add("gpu-memory-filled", f"{acc} on {_label(o)}")
                    changes["gpu_memory_gib"] = round(fill, 2)
                elif not (info.memory_range[0] <= mem / min(o.accelerator_count, 1.0)
                          <= info.memory_range[1]):
                    t.add("gpu-memory-range", f"{acc} {mem:g} GiB on {_label(o)}")
                    changes["gpu_memory_gib"] = round(fill, 2)
        elif o.accelerator_count:
            t.add("incomplete", _label(o))
            continue
        key = (o.provider, o.instance_type, o.region, acc or "", o.accelerator_count)
        if key in seen:
            t.add("duplicate", _label(o))
            continue
        seen.add(key)
        out.append(replace(o, **changes) if changes else o)
    return out, t.lines(_RULES)
