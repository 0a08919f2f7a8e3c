"""What a region offers: instance type facts (architecture, cluster placement groups, EFA),
the zones that sell the type, and the image to boot.

The default image is the newest AWS Deep Learning AMI with PyTorch on Ubuntu (OSS NVIDIA
driver) for the type's architecture, found by name among the images Amazon owns; when a
region has none, the Deep Learning Base AMI (driver and CUDA, no PyTorch). Either way the
driver is on the image, so bootstrap finds it instead of installing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import ProviderError, UserError, code_of

from .api import Api

DLAMI_OWNERS = ["amazon"]
DLAMI_NAMES: dict[str, tuple[str, ...]] = {
    "x86_64": ("Deep Learning OSS Nvidia Driver AMI GPU PyTorch * (Ubuntu 2?.04) *",
               "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 2?.04) *"),
    "arm64": ("Deep Learning ARM64 AMI OSS Nvidia Driver GPU PyTorch * (Ubuntu 2?.04) *",
              "Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 2?.04) *"),
}


class ImageNotFound(ProviderError):
    """The region has no image that fits: another region may."""


@dataclass(frozen=True)
class TypeInfo:
    name: str
    arch: str
    cluster_placement: bool
    efa: bool
    gpus: int
    efa_max: int = 0
    """NetworkInfo.EfaInfo.MaximumEfaInterfaces: EFA interfaces the type takes."""
    cards: tuple[tuple[int, bool], ...] = ()
    """NetworkInfo.NetworkCards: (NetworkCardIndex, whether it takes an efa-only interface)."""


@dataclass(frozen=True)
class Image:
    image_id: str
    name: str
    root_device: str
    size_gb: int


def type_info(api: Api, region: str, instance_type: str) -> TypeInfo | None:
    """Facts about ``instance_type`` in ``region``; None when the region does not have it."""
    try:
        found = api.call(region, "describe_instance_types",
                         InstanceTypes=[instance_type]).get("InstanceTypes", [])
    except ProviderError as exc:
        if code_of(exc).startswith("InvalidInstanceType"):
            return None
        raise
    if not found:
        return None
    t = found[0]
    archs = t.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
    arch = "arm64" if "arm64" in archs and "x86_64" not in archs else "x86_64"
    gpus = sum(int(g.get("Count", 0)) for g in t.get("GpuInfo", {}).get("Gpus", []))
    net = t.get("NetworkInfo", {})
    cards = tuple(sorted((int(c.get("NetworkCardIndex", 0)),
                          "efa-only" in (c.get("InterfaceTypes") or []))
                         for c in net.get("NetworkCards") or []))
    return TypeInfo(name=instance_type, arch=arch,
                    cluster_placement="cluster" in t.get("PlacementGroupInfo", {}).get(
                        "SupportedStrategies", []),
                    efa=bool(net.get("EfaSupported")), gpus=gpus,
                    efa_max=int((net.get("EfaInfo") or {}).get("MaximumEfaInterfaces") or 0),
                    cards=cards)


def offered_zones(api: Api, region: str, instance_type: str) -> list[str]:
    found = api.pages(region, "describe_instance_type_offerings", "InstanceTypeOfferings",
                      LocationType="availability-zone",
                      Filters=[{"Name": "instance-type", "Values": [instance_type]}])
    return sorted({o["Location"] for o in found})


def _image(img: dict[str, Any]) -> Image:
    root = str(img.get("RootDeviceName") or "/dev/sda1")
    size = 8
    for bdm in img.get("BlockDeviceMappings") or []:
        if bdm.get("DeviceName") == root and bdm.get("Ebs", {}).get("VolumeSize"):
            size = int(bdm["Ebs"]["VolumeSize"])
    return Image(str(img["ImageId"]), str(img.get("Name") or ""), root, size)


def newest(images: list[dict[str, object]]) -> dict[str, object] | None:
    ok = [i for i in images if i.get("State", "available") == "available"]
    return max(ok, key=lambda i: (str(i.get("CreationDate") or ""), str(i.get("Name") or "")),
               default=None)


def find_dlami(api: Api, region: str, arch: str) -> Image:
    for pattern in DLAMI_NAMES[arch]:
        found = api.call(region, "describe_images", Owners=DLAMI_OWNERS,
                         Filters=[{"Name": "name", "Values": [pattern]},
                                  {"Name": "state", "Values": ["available"]},
                                  {"Name": "architecture", "Values": [arch]}]).get("Images", [])
        best = newest(found)
        if best is not None:
            return _image(best)
    raise ImageNotFound(
        f"No AWS Deep Learning AMI ({arch}) found in {region}.",
        "Give an image in the task (resources.image: ami-...), or try another region.")


def find_image(api: Api, region: str, image: str | None, arch: str) -> Image:
    """The task's image (an AMI id, or a name pattern among your own and Amazon's images),
    else the newest Deep Learning AMI."""
    if not image:
        return find_dlami(api, region, arch)
    if image.startswith("ami-"):
        try:
            found = api.call(region, "describe_images", ImageIds=[image]).get("Images", [])
        except ProviderError as exc:
            if not code_of(exc).startswith("InvalidAMIID"):
                raise
            found = []
        if not found:
            raise ImageNotFound(f"Image {image} does not exist in {region} (AMI ids are per "
                                "region).", "Give the region's AMI id, or a name pattern.")
        return _image(found[0])
    found = api.call(region, "describe_images", Owners=["self", "amazon"],
                     Filters=[{"Name": "name", "Values": [image]},
                              {"Name": "architecture", "Values": [arch]}]).get("Images", [])
    best = newest(found)
    if best is None:
        raise ImageNotFound(f"No {arch} image named like '{image}' in {region}.",
                            "Check resources.image (an AMI id, or a name pattern with *).")
    return _image(best)


def check_disk(image: Image, disk_size_gb: int) -> None:
    if disk_size_gb < image.size_gb:
        raise UserError(f"resources.disk_size_gb {disk_size_gb} is smaller than the image's root "
                        f"volume ({image.size_gb} GiB, {image.name or image.image_id}).",
                        f"Set disk_size_gb to at least {image.size_gb}.")
