"""The public price sources ``catalog refresh`` reads: one module per cloud.

Each source's ``fetch`` takes the provider's offers from the current catalog (the shapes it
knows) and returns a :class:`SourceResult`: new prices keyed by :func:`offer_key`, offers for
known instance types in regions the catalog lacks, and the URLs it used. A source raises
:class:`SourceError` when it cannot finish; then nothing of it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...errors import ProviderError
from ..model import Offer

OfferKey = tuple[str, str | None, float, str]
Progress = Callable[[str], None]


def offer_key(o: Offer) -> OfferKey:
    """What identifies a row: GCP N1 rows share an instance type and differ by GPU."""
    return (o.instance_type, o.accelerator, float(o.accelerator_count), o.region)


@dataclass
class Quote:
    """Prices a source found for one offer; ``None``: the source has no value (keep the old)."""

    price: float | None = None
    spot_price: float | None = None


@dataclass
class SourceResult:
    provider: str
    updates: dict[OfferKey, Quote] = field(default_factory=dict)
    new_offers: list[Offer] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class SourceError(ProviderError):
    """A price source failed. ``unreachable``: the host could not be reached at all (offline,
    DNS, refused, timeout), as opposed to an answer we could not use."""

    def __init__(self, host: str, reason: str, unreachable: bool = False) -> None:
        super().__init__(f"{host}: {reason}")
        self.host = host
        self.reason = reason
        self.unreachable = unreachable


def noop(msg: str) -> None:
    pass
