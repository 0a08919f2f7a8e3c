"""What ``cloudtrain gpus`` shows of the catalog's offers: whole GPUs per node unless asked
(``--fractional``: AWS's g6f and similar slices sell 0.125, 0.25 ... of a GPU per node), and
identical offers in several regions (GCP repeats each per region) as one row."""

from __future__ import annotations

from dataclasses import dataclass

from cloudtrain.catalog.model import Offer


def whole(o: Offer) -> bool:
    """A whole number of GPUs per node (not a shared/vGPU slice)."""
    return float(o.accelerator_count).is_integer()


def split_fractional(offers: list[Offer]) -> tuple[list[Offer], int]:
    """The offers with whole GPUs per node, and how many were slices."""
    kept = [o for o in offers if whole(o)]
    return kept, len(offers) - len(kept)


def hidden_line(count: int) -> str:
    return (f"{count} offer{'s' if count != 1 else ''} with a fraction of a GPU per node "
            "(shared/vGPU slices, e.g. 0.125 of a GPU) hidden; --fractional shows them.")


@dataclass(frozen=True)
class Row:
    """One offer as the table shows it, with every region it is sold at this price in."""

    offer: Offer
    regions: tuple[str, ...]
    spot: tuple[float, float] | None = None
    """The lowest and highest spot price across those regions (None: no spot anywhere)."""

    @property
    def region_cell(self) -> str:
        """'us-east-1', or 'us-east-1 +4' (4 more regions at the same price)."""
        more = len(self.regions) - 1
        return self.regions[0] + (f" +{more}" if more else "")


def _key(o: Offer) -> tuple[object, ...]:
    # The price to the cent, as the table shows it: rows that read the same are one.
    return (o.provider, o.instance_type, o.accelerator, o.accelerator_count, o.gpu_memory_gib,
            o.vcpus, o.memory_gib, None if o.price is None else round(o.price, 2))


def fold(offers: list[Offer]) -> list[Row]:
    """Offers identical but for their region (and spot price, which varies by region), at
    the same price to the cent, as one row, in the order of the first of them. Only offers
    sold on demand fold (a spot-only offer's price is its spot price)."""
    rows: dict[tuple[object, ...], list[Offer]] = {}
    for i, o in enumerate(offers):
        rows.setdefault(_key(o) if o.price is not None else (i,), []).append(o)
    out = []
    for group in rows.values():
        spots = [o.spot_price for o in group if o.spot_price is not None]
        out.append(Row(group[0], tuple(dict.fromkeys(o.region for o in group)),
                       (min(spots), max(spots)) if spots else None))
    return out


def spot_cell(row: Row) -> str:
    """'0.34', or '0.29-0.46' across the row's regions; '-' where none sells spot."""
    if row.spot is None:
        return "-"
    lo, hi = row.spot
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"
