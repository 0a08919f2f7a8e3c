"""The catalog's typed records: what a cloud offers and what it costs. Shared by the catalog
loader, ``catalog refresh``, ``cloudtrain gpus``, the planner and the cost commands.

Prices are US dollars per hour for ONE node (one VM), on-demand and spot. For GCP GPUs that
attach to N1 hosts the offer is the host plus the GPUs (see ``host_type``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Offer:
    provider: str                    # aws | gcp | azure
    instance_type: str               # e.g. p4d.24xlarge, a2-highgpu-8g, Standard_ND96asr_v4,
                                     # n1-standard-8 (GCP N1 host with attached GPUs)
    accelerator: str | None          # canonical GPU name: A100, A100-80GB, H100, T4 ...; None: CPU
    accelerator_count: float         # GPUs per node (fractional for AWS g6f slices)
    gpu_memory_gib: float | None     # per GPU
    vcpus: float | None
    memory_gib: float | None
    region: str
    zones: tuple[str, ...] = ()
    price: float | None = None       # on-demand $/h per node; None: not sold on demand here
    spot_price: float | None = None  # spot $/h per node; None: no spot here
    arch: str | None = None
    host_type: str | None = None     # GCP N1 attachables: the host the GPUs are attached to

    @property
    def total_gpu_memory_gib(self) -> float | None:
        if self.gpu_memory_gib is None:
            return None
        return self.gpu_memory_gib * self.accelerator_count

    def hourly(self, spot: bool) -> float | None:
        return self.spot_price if spot else self.price


@dataclass(frozen=True)
class CatalogInfo:
    """Where the offers in use come from."""

    kind: str                        # "snapshot" (shipped in the package) | "user" (refreshed)
    path: str
    as_of: str                       # ISO date (or datetime) the prices were taken
    source: str                      # provenance, one line
    providers: tuple[str, ...] = ()
    corrections: tuple[str, ...] = field(default=())   # overrides applied, one line each


OFFER_FIELDS = ("provider", "instance_type", "accelerator", "accelerator_count", "gpu_memory_gib",
                "vcpus", "memory_gib", "region", "price_hourly_usd", "spot_price_hourly_usd")
"""The JSON contract for one offer (``gpus --json``, and every offer of ``cost --json``):
scripts rely on these names. Prices are USD per hour for one node, on-demand and spot (null
where the offer is not sold in that market); ``gpu_memory_gib`` is per GPU."""


def offer_json(o: Offer) -> dict[str, object]:
    """One offer as the JSON contract has it (OFFER_FIELDS), plus its zones, arch and host."""
    return {"provider": o.provider, "instance_type": o.instance_type,
            "accelerator": o.accelerator, "accelerator_count": o.accelerator_count,
            "gpu_memory_gib": o.gpu_memory_gib, "vcpus": o.vcpus, "memory_gib": o.memory_gib,
            "region": o.region, "price_hourly_usd": o.price, "spot_price_hourly_usd": o.spot_price,
            "zones": list(o.zones), "arch": o.arch, "host_type": o.host_type}
