"""What a size offers in a region (the Resource SKUs API: zones, generations, spot,
accelerated networking, premium disks) and the image to boot on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import ProviderError, UserError, code_of

from .api import Api, as_dict

HPC_IMAGE = {"publisher": "microsoft-dsvm", "offer": "ubuntu-hpc", "sku": "2204",
             "version": "latest"}
"""Ubuntu 22.04 HPC image (Hyper-V generation 2): NVIDIA driver, CUDA, NCCL, InfiniBand/RDMA
drivers and MPI installed; the default on every size that boots generation 2 (all the
NC A100 v4, ND A100 v4, ND H100 v5 and NCasT4_v3 sizes)."""
GEN1_IMAGE = {"publisher": "Canonical", "offer": "0001-com-ubuntu-server-jammy",
              "sku": "22_04-lts", "version": "latest"}
"""Plain Ubuntu 22.04 (generation 1) for the old sizes that boot only generation 1; bootstrap
installs the driver there."""


# --- sizes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SizeInfo:
    name: str
    region: str
    zones: tuple[str, ...]
    """Zones where the subscription may use the size (empty: a region without zones)."""
    restricted: bool
    """The size exists in the region but this subscription may not use it there."""
    accelerated_networking: bool
    generations: tuple[str, ...]
    premium_io: bool
    spot: bool


def _cap(caps: list[dict[str, Any]] | None, name: str) -> str:
    for c in caps or []:
        if str(c.get("name", "")).lower() == name.lower():
            return str(c.get("value", ""))
    return ""


def size_info(api: Api, region: str, size: str) -> SizeInfo | None:
    """What ``size`` offers in ``region`` for this subscription; None when it is not sold
    there."""
    skus = api.items(f"list VM sizes of {region}", api.c.compute.resource_skus.list,
                     filter=f"location eq '{region}'")
    for raw in skus:
        s = as_dict(raw)
        if str(s.get("resourceType", "")).lower() != "virtualmachines" or \
                str(s.get("name", "")).lower() != size.lower():
            continue
        info: dict[str, Any] = next((i for i in s.get("locationInfo") or []
                     if str(i.get("location", "")).lower() == region.lower()), {})
        zones = [str(z) for z in info.get("zones") or []]
        restricted = False
        for r in s.get("restrictions") or []:
            where = r.get("restrictionInfo") or {}
            if r.get("type") == "Location":
                restricted = True
            elif r.get("type") == "Zone":
                gone = {str(x) for x in where.get("zones") or []}
                zones = [z for z in zones if z not in gone]
                if not zones and info.get("zones"):
                    restricted = True
        gens = tuple(g.strip().upper() for g in (_cap(s.get("capabilities"), "HyperVGenerations")
                                                  or "V1").split(",") if g.strip())
        return SizeInfo(name=str(s.get("name")), region=region, zones=tuple(sorted(zones)),
                        restricted=restricted,
                        accelerated_networking=_cap(s.get("capabilities"),
                                                    "AcceleratedNetworkingEnabled") == "True",
                        generations=gens,
                        premium_io=_cap(s.get("capabilities"), "PremiumIO") == "True",
                        spot=_cap(s.get("capabilities"), "LowPriorityCapable") != "False")
    return None


# --- images -------------------------------------------------------------------------------------

def parse_image(image: str) -> dict[str, str]:
    """``publisher:offer:sku:version`` (a marketplace URN) or the id of a managed image or a
    gallery image version, as an imageReference."""
    if image.startswith("/subscriptions/"):
        return {"id": image}
    parts = image.split(":")
    if len(parts) != 4 or not all(parts):
        raise UserError(f"resources.image '{image}' is neither an image URN nor an image id.",
                        "Write publisher:offer:sku:version (e.g. microsoft-dsvm:ubuntu-hpc:2204:"
                        "latest) or the id of an image (/subscriptions/.../images/NAME).")
    return dict(zip(("publisher", "offer", "sku", "version"), parts))


def choose_image(image: str | None, generations: tuple[str, ...]) -> dict[str, str]:
    if image:
        return parse_image(image)
    return dict(HPC_IMAGE if "V2" in generations else GEN1_IMAGE)


def image_text(ref: dict[str, str]) -> str:
    if "id" in ref:
        return ref["id"]
    return ":".join(ref[k] for k in ("publisher", "offer", "sku", "version"))


def image_available(api: Api, region: str, ref: dict[str, str]) -> bool:
    """Whether the marketplace image (any version, or the one named) is offered in
    ``region``. Image ids are not checked (the VM's creation says)."""
    if "id" in ref:
        return True
    try:
        found = api.call(f"list versions of image {image_text(ref)} in {region}",
                         api.c.compute.virtual_machine_images.list, region, ref["publisher"],
                         ref["offer"], ref["sku"])
    except ProviderError as exc:
        if code_of(exc) in ("NotFound", "ResourceNotFound", "ArtifactNotFound"):
            return False
        raise
    names = [str(as_dict(v).get("name", "")) for v in found or []]
    return bool(names) and (ref["version"] == "latest" or ref["version"] in names)
